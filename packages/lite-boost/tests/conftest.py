from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

from spore import childproc

PARALLEL_WORKER = Path(__file__).with_name("parallel_worker.py")
HARD_TIMEOUT_S = 90


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(scenario: str, world: int = 2, timeout: float = 60) -> list[dict]:
    """Run ``parallel_worker.py SCENARIO`` on ``world`` gloo ranks at once; JSON per rank.

    ``timeout`` bounds the process group's setup; the whole run is killed after
    ``HARD_TIMEOUT_S`` seconds so a hang fails the test.
    """
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    command = [sys.executable, str(PARALLEL_WORKER), scenario]
    return childproc.run_json_all(
        [[*command, str(r), str(world), str(port), str(timeout)] for r in range(world)],
        env=env,
        timeout=HARD_TIMEOUT_S,
    )


@pytest.fixture(scope="session")
def launch_ranks():
    """``launch_ranks(scenario, world=2)``: every rank's JSON result of a parallel_worker run."""
    return _launch
