"""mfusion's hand-written passes, one module per family; each module lists its passes.

A pass module defines ``PASSES``: pass objects (``spore.PatternToPatternPass`` or
``spore.GraphPass``) with a short ``name``, a ``version`` (bumped whenever what it rewrites
changes), a ``priority`` (higher runs first, e.g. Add+RMSNorm before RMSNorm) and a one-line
``summary``. :func:`all_passes` collects them from every module of this package.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from typing import Any


@functools.cache
def all_passes() -> tuple[Any, ...]:
    """Every hand-written pass, by module name then listing order; names are unique."""
    found: list[Any] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        found.extend(getattr(module, "PASSES", ()))
    names = [p.name for p in found]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise RuntimeError(f"mfusion passes share the names {duplicates}")
    return tuple(found)
