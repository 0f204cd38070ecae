"""The one place hyperparallel's version is written."""

__version__ = "0.1.0"
