from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

import pytest

from mccl.benchmarks import free_port
from spore import childproc

WORKER = Path(__file__).with_name("worker.py")
HARD_TIMEOUT_S = 90


def launch(
    scenario: str,
    world: int,
    *,
    ranks: list[int] | None = None,
    timeout: float = 30,
    port: int | None = None,
    tmp: Path,
) -> tuple[list[dict], float]:
    """Run ``ranks`` (default: all) of a ``world``-rank scenario; JSON per rank, wall time.

    The ranks' temporary files (a distributed checkpoint) go under ``tmp``.
    """
    port = port or free_port()
    command = [sys.executable, str(WORKER), scenario]
    started = time.monotonic()
    results = childproc.run_json_all(
        [
            [*command, str(r), str(world), str(port), str(timeout)]
            for r in (range(world) if ranks is None else ranks)
        ],
        env=dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp)),
        timeout=HARD_TIMEOUT_S,
    )
    return results, time.monotonic() - started


@pytest.fixture
def ranks(tmp_path):
    return functools.partial(launch, tmp=tmp_path)
