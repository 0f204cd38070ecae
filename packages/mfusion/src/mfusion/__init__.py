"""mfusion: Inductor post-grad passes that rewrite model graphs into ``torch.ops.spore.*``.

    import torch, mfusion
    compiled = torch.compile(model, backend="spore")   # or: mfusion.enable(); torch.compile(model)

``MFUSION_DISABLE=rope,gelu`` (or :func:`disable_passes`) switches passes off by name.
"""

from __future__ import annotations

from mfusion._version import __version__
from mfusion.selection import disable_passes, disabled_passes, enable_passes, is_enabled


def enable() -> None:
    """Run mfusion's passes (and every other registered Spore pass) in later Inductor compiles.

    The same as :func:`spore.passes.enable`: idempotent, chains a pass the user already set.
    """
    from spore import passes

    passes.enable()


def pass_names() -> list[str]:
    """The short names of mfusion's hand-written passes, in registration order."""
    from mfusion.passes import all_passes

    return [p.name for p in all_passes()]


__all__ = [
    "__version__",
    "disable_passes",
    "disabled_passes",
    "enable",
    "enable_passes",
    "is_enabled",
    "pass_names",
]
