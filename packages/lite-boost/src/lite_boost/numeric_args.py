"""Numeric arguments as lite-boost takes them: integers exactly (numpy's and 0-d tensors'
too), never a bool, a float or a container that would reorder sizes."""

from __future__ import annotations

import collections.abc
import numbers
import operator
from typing import Any


def as_int(value: Any) -> int | None:
    """``value`` as an int (numpy or 0-d tensor integers taken), ``None`` for a bool, a float or
    anything else: an error, not truncated."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


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
