"""What HGP adds to the wire, and how differential privacy bounds what a client uploads."""

from ...common.privacy import PrivateRecord
from ..platform.statistics import DIAGONAL, FACTOR, PACKED_TRIU, Statistics

#: name of the record carrying a client's per-class statistics (strategies/hgp/gaussians.py)
STATS = "class-stats"

# With dp.clip = C the client clips every feature to norm C before its statistics
# (strategies/hgp/learner.py), so a class mean has norm <= C, and the unbiased covariance, positive
# semi-definite with trace sum ||x - mu||^2 / (n - 1) = n / (n - 1) (mean ||x||^2 - ||mu||^2)
# <= 2 C^2 (n >= 2; zero for n = 1), has Frobenius norm, and so upper-triangle and diagonal
# norms, <= 2 C^2. Classes and counts are the label histogram, sent in the clear.
PRIVATE_RECORDS = {STATS: PrivateRecord(bounded={"means": (1, 1.0), "cov-triu": (2, 2.0), "cov-diag": (2, 2.0)},
                                        public=("classes", "counts"))}

#: what the platform bounds where the run is defended (stats-bound)
STATISTICS = {STATS: Statistics(vectors=("means",), counts=("counts",), keys="classes", second_moments={
    "cov-triu": PACKED_TRIU, "cov-diag": DIAGONAL, "cov-factor": FACTOR})}
