"""spore-core's own plugin, listed as ``core`` by ``spore plugins --all``.

It contributes the core's doctor checks and the allocator benchmarks (``spore bench core``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from spore import hookimpl
from spore.bench import Benchmark
from spore.doctor import Report, core_checks
from spore.registry import Registry
from spore.runtime import system_env

WORKLOAD_ITERS = 5


@hookimpl
def spore_doctor(report: Report) -> None:
    core_checks(report)


def run_workload(workload: str, env: dict[str, str], iters: int = WORKLOAD_ITERS) -> dict:
    """Run ``spore._workloads`` in a child with ``env``; its JSON figures."""
    out = subprocess.run(
        [sys.executable, "-m", "spore._workloads", workload, "--iters", str(iters)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"workload {workload!r} exited {out.returncode}: {out.stderr[-1500:]}")
    return json.loads(out.stdout.splitlines()[-1])


def _envs() -> dict[str, dict[str, str]]:
    """Baseline: this environment on glibc defaults; candidate: this environment as it is."""
    return {"system": system_env(), "current": dict(os.environ)}


def _side(workload: str, which: str) -> Callable[[Any], dict]:
    return lambda envs: run_workload(workload, envs[which])


@hookimpl
def spore_register_benchmarks(registry: Registry[Benchmark]) -> None:
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
