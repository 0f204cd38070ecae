"""``spore bench mccl``: start-up critical path with a late peer, and the guard's cost."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from spore import childproc
from spore.bench import Benchmark

CHILD_TIMEOUT_S = 300


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(what: str, mode: str, ranks: int, *extra: str) -> dict[str, float]:
    """Start ``ranks`` child processes of ``mccl._startup`` at once; return rank 0's figures."""
    port = str(free_port())
    command = childproc.python("-m", "mccl._startup", what, "--mode", mode, "--port", port)
    results = childproc.run_json_all(
        [[*command, "--rank", str(rank), *extra] for rank in range(ranks)],
        timeout=CHILD_TIMEOUT_S,
    )
    return results[0]


def _side(what: str, mode: str, ranks: int) -> Callable[[Any], dict[str, float]]:
    return lambda _state: run_ranks(what, mode, ranks)


def benchmarks() -> list[Benchmark]:
    return [
        Benchmark(
            name="startup-late-peer",
            baseline=_side("startup", "sync", 2),
            candidate=_side("startup", "async", 2),
            baseline_label="init_process_group, then build the model (sync)",
            candidate_label="mccl.init_process_group_async while building the model",
            description=(
                "2 gloo ranks, the peer joins 0.6 s late; rank 0 builds 40 Linear(2048, 2048) "
                "layers; time from start to the first completed all_reduce"
            ),
            self_timed=True,
        ),
        Benchmark(
            name="guard-after-init",
            baseline=_side("guard", "sync", 1),
            candidate=_side("guard", "async", 1),
            baseline_label="dist.get_world_size() after a plain init",
            candidate_label="dist.get_world_size() after mccl's async init",
            description="per-call cost of reading the default group once init has finished",
            self_timed=True,
        ),
    ]
