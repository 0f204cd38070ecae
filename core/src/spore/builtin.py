"""spore-core's own plugin, listed as ``core`` by ``spore plugins --all``.

It contributes the core's doctor checks and the allocator benchmarks (``spore bench core``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from spore._workloads import run_workload
from spore.bench import Benchmark
from spore.doctor import Report, core_checks
from spore.hookspecs import hookimpl
from spore.registry import Registry
from spore.runtime import system_env


@hookimpl
def spore_doctor(report: Report) -> None:
    core_checks(report)


def _envs() -> dict[str, dict[str, str]]:
    """Baseline: this environment on glibc defaults; candidate: this environment as it is."""
    return {"system": system_env(), "current": dict(os.environ)}


def _side(workload: str, which: str) -> Callable[[Any], dict]:
    return lambda envs: run_workload(workload, envs[which])


def _small_ops(_state: Any) -> None:
    import torch

    x = torch.ones(64)
    for _ in range(100):
        x = x + 1


def _small_ops_counted(state: Any) -> None:
    from spore.modes import OpCounter

    with OpCounter():
        _small_ops(state)


def _wrapped_ops(state: Any) -> None:
    x = state
    for _ in range(100):
        x = x + 1


def _fallback_input(_state: Any = None) -> Any:
    import torch

    from spore.fallback import FallbackTensor

    return FallbackTensor(torch.ones(64))


def _mlp_inputs() -> Any:
    import torch

    from spore._workloads import _mlp_block

    torch.manual_seed(0)
    return _mlp_block(), torch.randn(8192, 256, requires_grad=True)


def _mlp_step(state: Any) -> None:
    block, x = state
    block(x).sum().backward()


def _mlp_step_offloaded(state: Any) -> None:
    from spore.memory import offload

    block, x = state
    with offload("disk"):
        out = block(x)
    out.sum().backward()


@hookimpl
def spore_register_benchmarks(registry: Registry[Benchmark]) -> None:
    registry.add(
        Benchmark(
            name="offload-disk-mlp-step",
            baseline=_mlp_step,
            candidate=_mlp_step_offloaded,
            baseline_label="MLP block 8192x256->2048 fwd+bwd, activations in memory",
            candidate_label="the same with spore.memory.offload('disk')",
            setup=_mlp_inputs,
            description="step-time cost of spilling saved activations to disk (below 1: slower)",
        )
    )
    registry.add(
        Benchmark(
            name="fallback-tensor-overhead",
            baseline=_small_ops,
            candidate=lambda _state: _wrapped_ops(_fallback_input()),
            baseline_label="100 small eager adds on a plain tensor",
            candidate_label="the same on a spore.FallbackTensor (default fallback)",
            description="per-op cost of the __fallback__ hook (a ratio below 1 is the slowdown)",
        )
    )
    registry.add(
        Benchmark(
            name="dispatch-mode-overhead",
            baseline=_small_ops,
            candidate=_small_ops_counted,
            baseline_label="100 small eager adds, no mode",
            candidate_label="the same under spore.OpCounter",
            description="per-op cost of a DispatchMode (a ratio below 1 is the slowdown)",
        )
    )
    for workload, what in (
        ("rmsnorm", "eager RMSNorm 8192x4096 fp32 forward"),
        ("mlp", "eager LayerNorm+MLP block 8192x256->2048 fp32 forward+backward"),
    ):
        registry.add(
            Benchmark(
                name=f"allocator-{workload}",
                baseline=_side(workload, "system"),
                candidate=_side(workload, "current"),
                baseline_label="glibc malloc defaults (child process)",
                candidate_label="spore bench --allocator setting (child process)",
                setup=_envs,
                description=f"{what}: same threads; the allocator is the one bench runs under",
                self_timed=True,
            )
        )
