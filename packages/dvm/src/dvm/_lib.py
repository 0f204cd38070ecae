"""The VM's C++ library, loaded with ctypes (C ABI; built by setup.py from csrc/).

On x86-64 there is one build per ISA level; the best this CPU runs is used, or the one the
``DVM_ISA`` environment variable names (``v4``, ``v3`` or ``base``).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from functools import cache

ABI_VERSION = 1
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
def library() -> tuple[ctypes.CDLL, str]:
    """The library in use and its build name (``DVM_ISA``, else the best of :func:`builds`)."""
    usable = builds()
    level = os.environ.get("DVM_ISA", "").strip() or usable[0]
    if level not in usable:
        raise ImportError(
            f"DVM_ISA={level!r} is not usable here: choose one of {', '.join(usable)} "
            f"(builds present that this CPU runs), or unset it"
        )
    lib = ctypes.CDLL(_built(level))
    lib.dvm_abi_version.restype = ctypes.c_int32
    if lib.dvm_abi_version() != ABI_VERSION:
        raise ImportError(f"dvm's {level} build has ABI {lib.dvm_abi_version()}: {_REBUILD}")
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    lib.dvm_run.restype = i32
    lib.dvm_run.argtypes = [p, p, i32, i32, i32, p, p, p, i32, p, p, p, p, i32, i32]
    lib.dvm_max_row.restype = i64
    return lib, level
