"""CPU runtime settings (threads, allocator) as they stand in this process."""

from __future__ import annotations

import os

RUNTIME_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "LD_PRELOAD")


def runtime_environment() -> dict[str, str]:
    """The environment variables that change CPU thread and allocator behaviour, sorted."""
    return {
        k: v
        for k, v in sorted(os.environ.items())
        if k in RUNTIME_VARIABLES or k.startswith("MALLOC_")
    }


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS exposes one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
