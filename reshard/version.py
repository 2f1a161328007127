"""reshard's version: one place, read by the package root (``reshard.__version__``), the CLI's
``--version``, the code identity written in every manifest, and the packaging metadata (setuptools
reads it from here without importing the package)."""

__version__ = "0.1.0"
