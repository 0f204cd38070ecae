"""mccl: start torch.distributed process groups in the background; collectives wait for them.

    handle = mccl.init_process_group_async("gloo", rank=rank, world_size=world)
    model = build_model()          # overlaps the rendezvous
    dist.all_reduce(t)             # waits for the init first, then runs

The names below are imported on first use, so loading the Spore plugin does not import torch.
"""

from __future__ import annotations

from typing import Any

from mccl._version import __version__

_API = (
    "InitFailedError",
    "InitHandle",
    "InitPendingError",
    "InitTimeoutError",
    "guard_installed",
    "init_process_group_async",
    "pending",
)


def __getattr__(name: str) -> Any:
    if name in _API:
        from mccl import init

        return getattr(init, name)
    raise AttributeError(f"module 'mccl' has no attribute {name!r}")


__all__ = ["__version__", *_API]
