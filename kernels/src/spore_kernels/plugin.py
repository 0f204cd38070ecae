"""spore-kernels' Spore hooks: the ops with their kernels, and the benchmarks."""

from __future__ import annotations

import spore
from spore.registry import OpRegistry, Registry


@spore.hookimpl
def spore_register_ops(registry: OpRegistry) -> None:
    from spore_kernels.ops import FAMILIES

    for family in FAMILIES:
        family.register(registry)


@spore.hookimpl
def spore_register_benchmarks(registry: Registry) -> None:
    from spore_kernels.benchmarks import benchmarks

    for case in benchmarks():
        registry.add(case)
