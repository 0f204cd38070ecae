"""spore-kernels' Spore hooks: the ops with their CPU kernels, and the benchmarks."""

from __future__ import annotations

import spore
from spore.registry import OpRegistry, Registry


@spore.hookimpl
def spore_register_ops(registry: OpRegistry) -> None:
    from spore_kernels import cpu, reference

    op = registry.define(
        "rms_norm", "(Tensor x, Tensor weight, float eps) -> Tensor", reference=reference.rms_norm
    )
    registry.kernel(op, "cpu", cpu.rms_norm, priority=10, supports=cpu.rms_norm_supports)


@spore.hookimpl
def spore_register_benchmarks(registry: Registry) -> None:
    from spore_kernels.benchmarks import benchmarks

    for case in benchmarks():
        registry.add(case)
