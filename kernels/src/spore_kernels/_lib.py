"""The C++ CPU library, loaded with ctypes (a plain shared library with a C ABI)."""

from __future__ import annotations

import ctypes
import importlib.util
from functools import cache

ABI_VERSION = 1
DTYPE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2}
STATUS = {1: "bad argument", 2: "unsupported dtype"}


class KernelError(RuntimeError):
    """The C++ library refused a call (it validates instead of crashing)."""


@cache
def library() -> ctypes.CDLL:
    """Load ``spore_kernels._cpu`` (built at install time) and declare its signatures."""
    spec = importlib.util.find_spec("spore_kernels._cpu")
    if spec is None or spec.origin is None:
        raise ImportError(
            "spore-kernels' C++ library is missing: reinstall with a C++ compiler present "
            "(pip install ./kernels)"
        )
    lib = ctypes.CDLL(spec.origin)
    lib.spore_abi_version.restype = ctypes.c_int32
    if lib.spore_abi_version() != ABI_VERSION:
        raise ImportError(f"{spec.origin} has ABI {lib.spore_abi_version()}, need {ABI_VERSION}")
    lib.spore_rms_norm.restype = ctypes.c_int32
    lib.spore_rms_norm.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_float,
        ctypes.c_int32,
        ctypes.c_int32,
    ]
    return lib


def check(status: int, what: str) -> None:
    if status != 0:
        raise KernelError(f"{what}: {STATUS.get(status, f'status {status}')}")
