from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mccl.benchmarks import free_port

WORKER = Path(__file__).with_name("worker.py")
HARD_TIMEOUT_S = 90


def launch(
    scenario: str,
    world: int,
    *,
    ranks: list[int] | None = None,
    timeout: float = 30,
    port: int | None = None,
) -> tuple[list[dict], float]:
    """Run ``ranks`` (default: all) of a ``world``-rank scenario; JSON per rank, wall time."""
    port = port or free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    started = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), scenario, str(r), str(world), str(port), str(timeout)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in (range(world) if ranks is None else ranks)
    ]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=HARD_TIMEOUT_S)
            assert proc.returncode == 0, f"{scenario}: exit {proc.returncode}\n{err[-3000:]}"
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            proc.kill()
    return results, time.monotonic() - started


@pytest.fixture
def ranks():
    return launch
