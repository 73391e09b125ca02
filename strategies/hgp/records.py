"""What HGP adds to the wire."""

#: name of the record carrying a client's per-class statistics (strategies/hgp/gaussians.py)
STATS = "class-stats"
