"""Methods: one folder per method (``fedavg``, ``fedcprompt``, ``fppl``, ``hepco``, ``hgp``,
``powder``, ``c2prompt``, ``lorm``, ``pilora``), each filling the hooks of the shared platform
(``platform/``); ``registry.py`` finds them (and methods other distributions register)."""
