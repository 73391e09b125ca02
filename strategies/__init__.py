"""Server strategies, one module per method (the registry of methods: ``client/methods.py``).

``base`` holds what every method shares (``PromptStrategy``, reply checks, per-slice
averaging), ``replies`` the reply schema and the robust aggregation rules.
"""
