"""Helpers that run ``spore train`` as a real command (child processes, gloo, hard timeouts)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

TIMEOUT_S = 240

SMALL = [
    "model.config.hidden_size=64",
    "model.config.intermediate_size=171",  # odd: FSDP2 shards it unevenly
    "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4",
    "model.config.num_key_value_heads=2",
    "data.seq_len=64",
    "data.batch_size=8",
    "schedule.warmup_steps=5",
]


def spore_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "spore", "train", *args]


def small_args(*extra: str) -> list[str]:
    out: list[str] = []
    for item in [*SMALL, *extra]:
        out += ["--set", item]
    return out


def run_train(
    *args: str, timeout: float = TIMEOUT_S, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """``spore train ARGS`` in a child process group, killed whole on timeout."""
    env = dict(os.environ, COLUMNS="120")
    proc = subprocess.Popen(
        spore_command(*args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"spore train timed out after {timeout} s:\n{out[-3000:]}\n{err[-3000:]}")
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check and done.returncode != 0:
        pytest.fail(f"spore train failed ({done.returncode}):\n{out[-3000:]}\n{err[-5000:]}")
    return done


def losses(output: Path) -> dict[int, float]:
    lines = (output / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}
