"""``spore bench hyperparallel``: the default run's step time under ``spore train`` (FSDP2 over
local ranks, one core each) against a plain single-process loop on the same model and global
batch using all the cores. Both sides run as child processes under the same allocator.

Both sides save a checkpoint half-way through the timed steps, as the default run does every
100 steps (``spore train`` with DCP, the loop with ``torch.save``): the step time is the median
over steps before and after it, and ``slowdown_after_checkpoint`` is the median step time after
the save over the median before it."""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

from hyperparallel.report import read_metrics, slowdown
from spore import childproc
from spore.bench import Benchmark
from spore.runtime import usable_cores

STEPS, WARMUP = 25, 5  # timed steps before the checkpoint, and as many after it
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
            str(2 * STEPS),
            "--warmup",
            str(WARMUP),
            "--checkpoint-after",
            str(STEPS),
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
                f"run.steps={WARMUP + 2 * STEPS}",
                "--set",
                f"checkpoint.every={WARMUP + STEPS}",
                "--set",
                "checkpoint.export=false",
            ],
            timeout=CHILD_TIMEOUT_S,
        )
        records = read_metrics(Path(tmp) / "metrics.jsonl")[WARMUP:]
    times = [r["step_time_s"] for r in records]
    return {
        "seconds": statistics.median(times),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records),
        "slowdown_after_checkpoint": slowdown(times[:STEPS], times[STEPS:]),
    }


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
        description="per-step time of the embedded default run, a checkpoint half-way",
        self_timed=True,
    )


def benchmarks() -> list[Benchmark]:
    """The default run as is (1 rank), and over 2 ranks sharing the cores (when there are 2)."""
    return [_case(n) for n in sorted({1, max(1, min(2, len(usable_cores())))})]
