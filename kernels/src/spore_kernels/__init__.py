"""spore-kernels: Spore's op library (``torch.ops.spore.*``) with fast C++ CPU kernels.

``import spore_kernels`` defines the ops with their kernels (C++ on CPU; Triton on CUDA and
torch_npu's fused ops on NPU when available) and loads no Spore plugin. ``spore ops`` lists them
as the ``kernels`` plugin's once the plugin manager loads it.
"""

from spore_kernels import registration
from spore_kernels._version import __version__


def load() -> None:
    """Define the ops (idempotent; kept as an alias: ``import spore_kernels`` already does)."""
    registration.define()


load()

__all__ = ["__version__", "load"]
