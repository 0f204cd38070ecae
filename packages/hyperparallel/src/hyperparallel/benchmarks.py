"""``spore bench hyperparallel``: the default run's step time under ``spore train`` (FSDP2 over
local ranks, one core each) against a plain single-process loop on the same model and global
batch using all the cores. Both sides run as child processes under the same allocator."""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

from spore import childproc
from spore.bench import Benchmark
from spore.runtime import usable_cores

STEPS, WARMUP = 25, 5
CHILD_TIMEOUT_S = 900


def _plain(nproc: int) -> dict[str, float]:
    return childproc.run_json(
        [
            sys.executable,
            "-m",
            "hyperparallel.plain_loop",
            "--set",
            f"parallel.nproc={nproc}",
            "--steps",
            str(STEPS),
            "--warmup",
            str(WARMUP),
        ],
        timeout=CHILD_TIMEOUT_S,
    )


def _spore_train(nproc: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="spore-bench-train-") as tmp:
        childproc.run(
            [
                sys.executable,
                "-m",
                "hyperparallel",
                "--nproc",
                str(nproc),
                "--output",
                tmp,
                "--set",
                f"run.steps={STEPS + WARMUP}",
                "--set",
                "checkpoint.every=0",
                "--set",
                "checkpoint.export=false",
            ],
            timeout=CHILD_TIMEOUT_S,
        )
        lines = (Path(tmp) / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines][WARMUP:]
    step = statistics.median(r["step_time_s"] for r in records)
    return {"seconds": step, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records)}


def _case(nproc: int) -> Benchmark:
    cores = len(usable_cores())
    return Benchmark(
        name=f"train-default-step-{nproc}rank{'s' if nproc > 1 else ''}",
        baseline=lambda _: _plain(nproc),
        candidate=lambda _: _spore_train(nproc),
        baseline_label=(
            f"plain single-process PyTorch loop, same model and global batch, {cores} threads"
        ),
        candidate_label=(
            f"spore train, FSDP2 over {nproc} ranks" if nproc > 1 else "spore train, 1 rank"
        ),
        description="per-step time of the embedded default run",
        self_timed=True,
    )


def benchmarks() -> list[Benchmark]:
    """The default run as is (1 rank), and over 2 ranks sharing the cores (when there are 2)."""
    return [_case(n) for n in sorted({1, max(1, min(2, len(usable_cores())))})]
