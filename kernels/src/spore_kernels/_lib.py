"""The C++ CPU library, loaded with ctypes (a plain shared library with a C ABI).

On x86-64 three builds are installed (``_cpu_v4``, ``_cpu_v3``, ``_cpu_base``); the best one
this CPU runs is loaded, or the one ``SPORE_KERNELS_ISA`` (v4, v3, base) names.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from collections.abc import Sequence
from functools import cache

import torch

ABI_VERSION = 2
ISAS = ("v4", "v3", "base")
LEVEL = {"v4": 4, "v3": 3, "base": 1}
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
STATUS = {1: "bad argument", 2: "unsupported dtype", 3: "out of memory for scratch"}

ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class KernelError(RuntimeError):
    """The C++ library refused a call (it validates instead of crashing)."""


def _path(isa: str) -> str | None:
    spec = importlib.util.find_spec(f"spore_kernels._cpu_{isa}")
    return spec.origin if spec is not None else None


@cache
def load(isa: str) -> ctypes.CDLL:
    """The ``isa`` build (v4, v3 or base), ABI-checked; ``ImportError`` when it cannot load."""
    if isa not in ISAS:
        raise ImportError(f"unknown spore-kernels build {isa!r}: choose one of {', '.join(ISAS)}")
    path = _path(isa)
    if path is None:
        raise ImportError(
            f"spore-kernels' C++ library ({isa} build) is missing: reinstall with a C++ "
            f"compiler present (pip install ./kernels)"
        )
    if LEVEL[isa] > _cpu_level():
        raise ImportError(f"spore-kernels' {isa} build needs an x86-64-{isa} CPU; this one is not")
    lib = ctypes.CDLL(path)
    lib.spore_abi_version.restype = i32
    if lib.spore_abi_version() != ABI_VERSION:
        raise ImportError(f"{path} has ABI {lib.spore_abi_version()}, need {ABI_VERSION}")
    return lib


@cache
def _cpu_level() -> int:
    base = _path("base")
    if base is None:
        raise ImportError(
            "spore-kernels' C++ library is missing: reinstall with a C++ compiler present "
            "(pip install ./kernels)"
        )
    return ctypes.CDLL(base).spore_cpu_level()


def available() -> list[str]:
    """The builds installed that this CPU runs, best first."""
    return [isa for isa in ISAS if _path(isa) is not None and LEVEL[isa] <= _cpu_level()]


@cache
def library() -> ctypes.CDLL:
    """The build in use: ``SPORE_KERNELS_ISA`` (v4, v3, base) if set, else the best available."""
    forced = os.environ.get("SPORE_KERNELS_ISA", "").strip()
    if forced:
        return load(forced)
    return load(available()[0])  # base is always among them (else _cpu_level raised)


@cache
def function(
    name: str, argtypes: Sequence[type], lib: ctypes.CDLL | None = None
) -> ctypes._CFuncPtr:
    """``name`` in the build in use (or ``lib``), argument types declared, returning a status."""
    fn = getattr(lib or library(), name)
    fn.restype = i32
    fn.argtypes = list(argtypes)
    return fn


_bound: dict[str, ctypes._CFuncPtr] = {}
"""``call``'s functions by name (each op passes one argument list per name)."""


def call(name: str, argtypes: Sequence[type], *args: object) -> None:
    """Call ``name`` and raise :class:`KernelError` on a non-zero status."""
    fn = _bound.get(name)
    if fn is None:
        fn = _bound[name] = function(name, tuple(argtypes))
    status = fn(*args)
    if status != 0:
        raise KernelError(f"{name}: {STATUS.get(status, f'status {status}')}")


def dtype_code(t: torch.Tensor) -> int:
    return DTYPE_CODES[t.dtype]


def threads() -> int:
    """The thread count kernels use: torch's own (``torch.get_num_threads()``)."""
    return torch.get_num_threads()
