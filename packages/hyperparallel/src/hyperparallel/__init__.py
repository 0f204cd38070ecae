"""hyperparallel: `spore train`, YAML-configured distributed training of Hugging Face models.

    spore train                                  # the embedded default: learns in about a minute
    spore train run.yaml --nproc 2 --set optim.lr=1e-3

The trainer is importable too: :func:`hyperparallel.config.load` builds a validated
:class:`hyperparallel.config.Config`; :func:`hyperparallel.launch.launch` runs it.
"""

from hyperparallel._version import __version__

__all__ = ["__version__"]
