"""The one place dvm's version is written."""

__version__ = "0.1.0"
