"""The one place spore-kernels' version is written."""

__version__ = "0.1.0"
