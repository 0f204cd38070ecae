"""sci-protenix's benchmark cases (``spore bench sci-protenix``)."""

from __future__ import annotations

from typing import Any


def benchmarks() -> list[Any]:
    """Every sci-protenix benchmark case."""
    return []
