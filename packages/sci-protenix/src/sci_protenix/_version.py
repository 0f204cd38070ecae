"""The one place sci-protenix's version is written."""

__version__ = "0.1.0"
