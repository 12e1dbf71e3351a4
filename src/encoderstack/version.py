"""The package's version, in a module of its own: every module records it without importing the package itself."""

__version__ = "0.1.0"
