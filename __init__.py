"""promptfcl: federated class-incremental learning with prompted, frozen Vision Transformers.

The repository's root is the package (``pyproject.toml``: ``package-dir``): its layers' folders
install as ``promptfcl.common``, ``promptfcl.strategies``, ``promptfcl.client`` and
``promptfcl.server``. Inside the package every import of the project is relative, so a tool that
reads the checkout (a type checker, an editor, an import graph) follows them without installing it.
"""
