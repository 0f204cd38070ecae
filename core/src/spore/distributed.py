"""Starting ``torch.distributed`` through plugins (``spore_init_process_group``).

Trainers and launchers call :func:`init_process_group`: a plugin such as mccl may start the
group in the background and return at once; without one the group is started synchronously.
"""

from __future__ import annotations

from typing import Any

from spore.plugins import get_manager


class ReadyHandle:
    """The handle of a group that was started synchronously: already done."""

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> Any:
        import torch.distributed as dist

        return dist.group.WORLD

    def exception(self) -> BaseException | None:
        return None


def init_process_group(backend: str | None = None, **options: Any) -> Any:
    """Start the default process group; returns a handle with ``wait()`` and ``done()``.

    ``options`` are ``torch.distributed.init_process_group`` keyword arguments. The first
    plugin implementing ``spore_init_process_group`` that returns a handle starts it;
    otherwise it is started here, synchronously, and a :class:`ReadyHandle` is returned.
    """
    taken = get_manager().first_result(
        "spore_init_process_group", backend=backend, options=dict(options)
    )
    if taken is not None:
        return taken[1]
    import torch.distributed as dist

    dist.init_process_group(backend=backend, **options)
    return ReadyHandle()
