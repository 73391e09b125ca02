"""Methods: one folder per method (``fedavg``, ``fedcprompt``, ``fppl``, ``hepco``, ``hgp``,
``powder``), each filling the hooks of the shared platform (``platform/``); ``registry.py`` finds
them (and methods other distributions register)."""
