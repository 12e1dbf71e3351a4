"""The package's version, its one source (pyproject.toml reads it from here), in a module of its own so that every
module can record it without importing the package."""

__version__ = "0.1.0"
