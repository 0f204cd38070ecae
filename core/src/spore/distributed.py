"""Starting ``torch.distributed`` through plugins (``spore_init_process_group``).

Trainers and launchers call :func:`init_process_group`: a plugin such as mccl may start the
group in the background and return at once; without one the group is started synchronously.
"""

from __future__ import annotations

import math
import numbers
import weakref
from datetime import timedelta
from typing import Any

from spore.plugins import get_manager


class ReadyHandle:
    """The handle of a group that was started synchronously: already done."""

    def __init__(self, group: Any) -> None:
        self._group = weakref.ref(group)

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> Any:
        """The group this init created (ready: ``timeout`` is not needed); ``RuntimeError`` once
        that group has been destroyed, as mccl's handle raises."""
        import torch.distributed as dist

        group = self._group()
        if group is None or group is not dist.group.WORLD:
            raise RuntimeError(
                "the process group spore.distributed.init_process_group created has been "
                "destroyed (torch.distributed.destroy_process_group()); start a new init for "
                "another"
            )
        return group

    def exception(self) -> BaseException | None:
        return None


def time_limit(value: object, name: str = "init_timeout") -> float:
    """``value`` (seconds, or a ``timedelta``) in seconds; a ``TypeError`` or ``ValueError``
    naming ``name`` unless it is a positive, finite time."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(
            f"{name} must be a number of seconds > 0 or a datetime.timedelta, got "
            f"{value!r} ({type(value).__name__}): pass e.g. {name}=600"
        )
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{name} must be a positive, finite time, got {value!r}")
    return seconds


def init_process_group(backend: str | None = None, **options: Any) -> Any:
    """Start the default process group; returns a handle with ``wait()`` and ``done()``.

    ``options`` are ``torch.distributed.init_process_group`` keyword arguments, and
    ``init_timeout`` (seconds or a ``timedelta``), which bounds the wait for the group. The
    first plugin implementing ``spore_init_process_group`` that returns a handle starts it;
    otherwise it is started here, synchronously, with ``init_timeout`` as torch's ``timeout``
    (unless ``timeout`` is given), and a :class:`ReadyHandle` is returned.
    """
    taken = get_manager().first_result(
        "spore_init_process_group", backend=backend, options=dict(options)
    )
    if taken is not None:
        return taken[1]
    import torch.distributed as dist

    init_timeout = options.pop("init_timeout", None)
    if init_timeout is not None:
        limit = timedelta(seconds=time_limit(init_timeout))
        if options.get("timeout") is None:
            options["timeout"] = limit
    dist.init_process_group(backend=backend, **options)
    return ReadyHandle(dist.group.WORLD)
