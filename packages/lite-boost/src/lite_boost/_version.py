"""The one place lite-boost's version is written."""

__version__ = "0.1.0"
