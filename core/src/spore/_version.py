"""The one place spore-core's version is written."""

__version__ = "0.1.0"
