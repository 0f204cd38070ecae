"""spore-kernels: Spore's op library (``torch.ops.spore.*``) with fast C++ CPU kernels.

Ops are defined when the plugin loads (``spore.get_registry("ops")`` or ``spore ops``);
:func:`load` does it explicitly.
"""

from spore_kernels._version import __version__


def load() -> None:
    """Load Spore's plugins so that ``torch.ops.spore.*`` exist in this process."""
    import spore

    spore.get_registry("ops")


__all__ = ["__version__", "load"]
