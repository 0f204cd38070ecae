"""The one place mfusion's version is written."""

__version__ = "0.1.0"
