"""mccl as a Spore plugin: the contract, the core's init hook, doctor, benchmarks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

import mccl
from mccl.benchmarks import free_port
from mccl.init import _address, _reachability
from spore.distributed import init_process_group


def test_contract(spore_plugin_contract) -> None:
    info = spore_plugin_contract("mccl")
    assert info.registered["benchmarks"] == ["guard-after-init", "startup-late-peer"]
    assert "spore_init_process_group" in info.hooks


def test_loading_the_plugin_does_not_import_torch() -> None:
    code = "import sys, mccl.plugin; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False"


def test_spore_init_process_group_goes_through_mccl(spore_manager) -> None:
    spore_manager()
    handle = init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        assert isinstance(handle, mccl.InitHandle)
        assert dist.get_world_size() == 1
        assert handle.done()
        assert handle.wait() is dist.group.WORLD
        assert not mccl.guard_installed()
    finally:
        dist.destroy_process_group()


def test_without_mccl_the_core_starts_the_group_synchronously(spore_manager) -> None:
    spore_manager({"SPORE_DISABLE_PLUGINS": "mccl"})
    handle = init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        assert type(handle).__name__ == "ReadyHandle"
        assert handle.done()
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


def test_bad_init_timeout() -> None:
    with pytest.raises(ValueError, match="init_timeout must be positive"):
        mccl.init_process_group_async("gloo", init_timeout=-1)
    assert mccl.pending() is None
    assert not mccl.guard_installed()


def test_address_and_reachability_hints(monkeypatch) -> None:
    assert _address({"init_method": "tcp://10.0.0.1:29500"}) == "tcp://10.0.0.1:29500"
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1234")
    assert _address({}) == "env://127.0.0.1:1234"
    port = free_port()
    assert "is not reachable" in _reachability(f"tcp://127.0.0.1:{port}")
    assert _reachability("file:///tmp/x") == ""


def _spore(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("SPORE_")} | (env or {})
    return subprocess.run(
        [sys.executable, "-m", "spore", *args],
        capture_output=True,
        text=True,
        env=full,
        timeout=600,
    )


def test_doctor_reports_backends_and_rendezvous() -> None:
    out = _spore(
        "doctor",
        "--json",
        "--quick",
        env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())},
    )
    checks = {c["name"]: c for c in json.loads(out.stdout)["checks"] if c["source"] == "mccl"}
    assert checks["mccl backends"]["status"] == "ok"
    assert "gloo" in checks["mccl backends"]["detail"]
    assert "is not reachable" in checks["mccl rendezvous"]["detail"]


def test_benchmarks_produce_ratios() -> None:
    out = _spore("bench", "mccl", "--json", "--repeat", "1")
    assert out.returncode == 0, out.stderr
    results = {r["name"]: r for r in json.loads(out.stdout)["results"]}
    startup = results["startup-late-peer"]
    assert startup["error"] is None
    assert startup["ratio"] > 0
    for side in ("baseline", "candidate"):
        assert startup["extras"][side]["setup_s"] > 0
    assert startup["baseline_s"] > startup["extras"]["baseline"]["setup_s"]
    guard = results["guard-after-init"]
    assert guard["error"] is None
    assert guard["candidate_s"] > 0
