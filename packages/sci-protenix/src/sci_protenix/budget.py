"""Memory budgets: ``"4GiB"``, ``"512MiB"``, ``"0.5"`` (of free memory) or bytes, as bytes."""

from __future__ import annotations

import re
from decimal import ROUND_CEILING, Decimal

import torch

UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
MAX_BYTES = 2**64
"""The largest budget taken: no machine comes near it, and a float would no longer count its
bytes exactly."""
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
_HINT = (
    "write it as bytes (an int), a size such as '4GiB' or '512MiB', "
    "or a fraction of free memory in (0, 1] such as '0.5'"
)


def free_memory(device: str | torch.device = "cpu") -> int:
    """Bytes free on ``device``: ``torch.cuda.mem_get_info`` on CUDA; else MemAvailable."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                "no CUDA device is available to measure free memory on; give the budget in "
                "bytes or run on a machine with CUDA"
            )
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    if dev.type != "cpu":
        raise ValueError(
            f"free memory of a {dev.type!r} device is unknown; give the budget in bytes"
        )
    try:
        import psutil
    except ImportError:
        return _mem_available()
    return int(psutil.virtual_memory().available)


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    raise RuntimeError(
        "free CPU memory is unknown here (no psutil, no /proc/meminfo MemAvailable); "
        "give the budget as a size such as '4GiB'"
    )


def parse_budget(budget: int | float | str, *, device: str | torch.device = "cpu") -> int:
    """A memory budget in bytes.

    ``budget``: bytes (int), a size with a unit (``"4GiB"``, ``"512MiB"``, ``"2GB"``, ``"1.5 GiB"``;
    binary and decimal units, case-insensitive) or a fraction of the memory free now on ``device``
    in (0, 1] (``0.5`` or ``"0.5"``).
    """
    if isinstance(budget, bool):
        raise TypeError(f"budget must be bytes, a size or a fraction, got {budget!r}; {_HINT}")
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"budget must be positive, got {budget} bytes; {_HINT}")
        if budget > MAX_BYTES:
            raise ValueError(f"budget {budget} is more than 16 EiB (2**64 bytes); {_HINT}")
        return budget
    if isinstance(budget, float):
        return _fraction(budget, device)
    if not isinstance(budget, str):
        raise TypeError(f"budget must be bytes, a size or a fraction, got {budget!r}; {_HINT}")
    match = _SIZE.match(budget)
    if match is None:
        raise ValueError(f"budget {budget!r} is not a size; {_HINT}")
    number, unit = match.groups()
    if unit.lower() not in UNITS:
        raise ValueError(
            f"budget {budget!r}: unknown unit {unit!r} (known: KiB, MiB, GiB, TiB, KB, MB, GB, "
            f"TB, or none for bytes)"
        )
    if not unit and "." in number:
        return _fraction(float(number), device)
    size = int(Decimal(number) * UNITS[unit.lower()])  # exact, for any number of digits
    if size <= 0:
        raise ValueError(f"budget {budget!r} is not positive; {_HINT}")
    if size > MAX_BYTES:
        raise ValueError(f"budget {budget!r} is more than 16 EiB (2**64 bytes); {_HINT}")
    return size


def _fraction(value: float, device: str | torch.device) -> int:
    if not 0 < value <= 1:
        raise ValueError(
            f"a fractional budget must be in (0, 1] (of free memory), got {value}; {_HINT}"
        )
    size = int(value * free_memory(device))
    if size <= 0:
        raise ValueError(
            f"a fractional budget of {value} is less than a byte of free memory; {_HINT}"
        )
    return size


def format_bytes(n: int, *, up: bool = False) -> str:
    """``n`` bytes with a binary unit, e.g. ``'1.50 GiB'``; ``up`` rounds up, not to nearest
    (a budget named as the least that fits must fit)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:  # in Decimal: a float overflows past 2**1064 bytes
            value = Decimal(n) / size
            if up:
                value = (value * 100).to_integral_value(rounding=ROUND_CEILING) / 100
            return f"{value:.2f} {unit}"
    return f"{n} B"
