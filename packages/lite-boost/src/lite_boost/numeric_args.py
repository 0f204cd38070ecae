"""Numeric arguments as lite-boost takes them: integers exactly (numpy's and 0-d tensors'
too), never a bool, a float or a container that would reorder sizes; real numbers (numpy's
too), never a bool; narrow floats as written."""

from __future__ import annotations

import collections.abc
import math
import numbers
import operator
from typing import Any

import torch


def as_int(value: Any) -> int | None:
    """``value`` as an int (numpy or 0-d tensor integers taken), ``None`` for a bool, a float or
    anything else: an error, not truncated."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def int_at_least(value: Any, name: str, minimum: int, unit: str = "") -> int:
    """``value`` as an int of at least ``minimum`` (see :func:`as_int`), else a ``ValueError``
    naming the argument ``name`` (and its ``unit``, when given)."""
    n = as_int(value)
    if n is None or n < minimum:
        what = f" ({unit})" if unit else ""
        raise ValueError(f"{name} must be an int >= {minimum}{what}, got {value!r}")
    return n


def as_ints(values: Any) -> tuple[int, ...] | None:
    """``values``' items as ints (see :func:`as_int`), ``None`` when it is not an ordered
    sequence (a set or a dict would reorder the sizes) or an item is not an integer."""
    if isinstance(values, (collections.abc.Set, collections.abc.Mapping, collections.abc.Iterator)):
        return None
    try:
        ints = tuple(as_int(n) for n in values)
    except TypeError:  # not iterable
        return None
    return None if None in ints else ints


def is_number(value: Any) -> bool:
    """Whether ``value`` is a real number (numpy's too), not a bool, a string or a tensor."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def as_written(value: Any) -> Any:
    """A numpy float narrower than Python's (float16, float32) as the Python float of its
    shortest decimal, which its own type reads back as it (numpy's ``str``): the number as it
    was written, ``np.float32(0.7)`` as ``0.7``, not ``0.699999988079071``; anything else as it
    is."""
    dtype = getattr(value, "dtype", None)
    if is_number(value) and dtype is not None and dtype.kind == "f" and dtype.itemsize < 8:
        return float(str(value))
    return value


def as_real(value: Any) -> float | None:
    """``value`` as a float when it is a real number (numpy's, or a 0-d integer or floating
    tensor's), ``None`` for a bool, a complex, a string or a tensor of more than one element;
    an int too large for a float is ``inf``."""
    if isinstance(value, torch.Tensor):
        if value.dim() or value.dtype == torch.bool or value.is_complex():
            return None
        value = value.item()
    if not is_number(value):
        return None
    try:
        return float(value)
    except OverflowError:  # an int beyond the float range
        return math.inf if value > 0 else -math.inf
