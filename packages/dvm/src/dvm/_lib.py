"""The VM's C++ library, loaded with ctypes (C ABI; built by setup.py from csrc/).

On x86-64 there is one build per ISA level; the best this CPU runs is used, or the one the
``DVM_ISA`` environment variable names (``v4``, ``v3`` or ``base``).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from functools import cache

ABI_VERSION = 2
NEEDS = {"v4": 4, "v3": 3, "base": 1}  # build -> CPU level (dvm_cpu_level) it needs

_REBUILD = "reinstall dvm with a C++ compiler present (pip install ./packages/dvm)"


def _built(level: str) -> str | None:
    spec = importlib.util.find_spec(f"dvm._vm_{level}")
    return None if spec is None else spec.origin


@cache
def cpu_level() -> int:
    """4 for an x86-64-v4 CPU, 3 for x86-64-v3, else 1 (asked of the base build)."""
    base = _built("base")
    if base is None:
        raise ImportError(f"dvm's C++ VM is not built: {_REBUILD}")
    return int(ctypes.CDLL(base).dvm_cpu_level())


def builds() -> list[str]:
    """The builds present that this CPU runs, best first."""
    return [b for b, need in NEEDS.items() if need <= cpu_level() and _built(b)]


@cache
def load(level: str) -> ctypes.CDLL:
    """The ``level`` build (``v4``, ``v3`` or ``base``), ABI-checked."""
    usable = builds()
    if level not in usable:
        raise ImportError(
            f"dvm build {level!r} is not usable here: choose one of {', '.join(usable)} "
            f"(the builds present that this CPU runs)"
        )
    lib = ctypes.CDLL(_built(level))
    lib.dvm_abi_version.restype = ctypes.c_int32
    if lib.dvm_abi_version() != ABI_VERSION:
        raise ImportError(f"dvm's {level} build has ABI {lib.dvm_abi_version()}: {_REBUILD}")
    lib.dvm_run.restype = ctypes.c_int32
    lib.dvm_max_row.restype = ctypes.c_int64
    return lib


@cache
def library() -> tuple[ctypes.CDLL, str]:
    """The library in use and its build: ``DVM_ISA`` (read once) if set, else the best of
    :func:`builds`. ``ImportError`` when the VM is not built; ``ValueError`` when ``DVM_ISA``
    names a build that is not present or that this CPU does not run."""
    wanted = os.environ.get("DVM_ISA", "").strip()
    usable = builds()
    if wanted and wanted not in usable:
        raise ValueError(
            f"DVM_ISA={wanted!r} is not a dvm build this machine runs: set one of "
            f"{', '.join(usable)}, or unset it for the best one"
        )
    level = wanted or usable[0]
    return load(level), level


@cache
def run_address(level: str) -> int:
    """The address of the ``level`` build's ``dvm_run``, which ``dvm._launcher`` calls."""
    return int(ctypes.cast(load(level).dvm_run, ctypes.c_void_p).value)


@cache
def max_row(level: str) -> int:
    """The longest row the ``level`` build reduces (a reducing program's row is one tile)."""
    return int(load(level).dvm_max_row())
