"""Helpers that run ``spore train`` as a real command (child processes, gloo, hard timeouts),
or one rank of it in the test's own process."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from hyperparallel import config, train
from spore import childproc
from spore.testing import clean_environ

TIMEOUT_S = 300

SMALL = [
    "model.config.hidden_size=64",
    "model.config.intermediate_size=171",  # odd: FSDP2 shards it unevenly
    "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4",
    "model.config.num_key_value_heads=2",
    "data.seq_len=64",
    "data.batch_size=8",
    "schedule.warmup_steps=5",
    "parallel.threads=1",  # OpenMP teams of 2 spin-wait for minutes per step on a busy machine
]


def spore_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "spore", "train", *args]


def start_train(output: Path, *args: str, stderr: int = subprocess.DEVNULL) -> subprocess.Popen:
    """``spore train --nproc 2 --output OUTPUT ARGS`` started in its own session (a test can
    signal the whole job), its stdout discarded; the caller waits for it or kills it."""
    return subprocess.Popen(
        spore_command("--nproc", "2", "--output", str(output), *args),
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        text=True,
        env=clean_environ(),
        start_new_session=True,
    )


def small_args(*extra: str) -> list[str]:
    out: list[str] = []
    for item in [*SMALL, *extra]:
        out += ["--set", item]
    return out


def run_train(
    *args: str, timeout: float = TIMEOUT_S, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``spore train ARGS`` through :mod:`spore.childproc` (its process group killed whole on
    timeout), without the caller's ``SPORE_*`` variables, with ``env`` added. Unlike the
    ``run_spore`` fixture it also serves module-scoped fixtures: runs that several tests share."""
    try:
        done = childproc.run(
            spore_command(*args),
            timeout=timeout,
            env=clean_environ({"COLUMNS": "120", **(env or {})}),
            check=False,
        )
    except childproc.ChildError as exc:
        pytest.fail(str(exc), pytrace=False)
    if check and done.returncode != 0:
        pytest.fail(
            f"spore train failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
        )
    return done


def losses(output: Path) -> dict[int, float]:
    lines = (output / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


@dataclass(frozen=True)
class Run:
    """A finished ``spore train`` run: its output directory and its captured output."""

    output: Path
    done: subprocess.CompletedProcess[str]

    @property
    def losses(self) -> dict[int, float]:
        return losses(self.output)


def train_run(output: Path, *args: str, env: dict[str, str] | None = None) -> Run:
    """Run ``spore train --output OUTPUT ARGS`` (``env`` added) and keep what it left."""
    return Run(output, run_train("--output", str(output), *args, env=env))


def train_in_process(output: Path, *sets: str, resume: str | None = None) -> None:
    """One rank of ``spore train --output OUTPUT --set SMALL... --set SETS [--resume RESUME]``
    in this process: the worker's own run over a one-rank gloo group (no launcher, no
    preflight), seconds for a few steps. Its torch thread count is put back after."""
    cfg = config.load(overrides=[*SMALL, *sets, f"run.output={json.dumps(str(output))}"])
    with socket.socket() as sock:  # a free port for the group's store
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        try:
            train._run(cfg.to_dict(), resume)
        finally:
            torch.set_num_threads(threads)
