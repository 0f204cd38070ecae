"""mccl as a Spore plugin: the contract, the core's init hook, doctor, benchmarks."""

from __future__ import annotations

import datetime
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch.distributed as dist

import mccl
from mccl import plugin, rendezvous
from mccl.benchmarks import free_port
from spore import childproc
from spore.distributed import init_process_group
from spore.doctor import Check, Report


def test_contract(spore_plugin_contract) -> None:
    info = spore_plugin_contract("mccl")
    assert info.registered["benchmarks"] == ["guard-after-init", "startup-late-peer"]
    assert "spore_init_process_group" in info.hooks


def test_loading_the_plugin_does_not_import_torch() -> None:
    code = "import json, sys, mccl.plugin; print(json.dumps({'torch': 'torch' in sys.modules}))"
    assert childproc.run_json([sys.executable, "-c", code], timeout=60) == {"torch": False}


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


@pytest.mark.parametrize("bad", [-1, 0, 0.0, float("nan"), float("inf")])  # 0: "not given"
def test_bad_init_timeout(bad: float) -> None:
    with pytest.raises(ValueError, match=r"init_timeout must be a positive, finite time, got"):
        mccl.init_process_group_async("gloo", init_timeout=bad)
    with pytest.raises(ValueError, match=r"^timeout must be a positive, finite time, got "):
        mccl.init_process_group_async("gloo", timeout=datetime.timedelta(0))
    assert mccl.pending() is None
    assert not mccl.guard_installed()


def test_rendezvous_address_and_probe(monkeypatch) -> None:
    assert rendezvous.address({"init_method": "tcp://10.0.0.1:29500"}) == "tcp://10.0.0.1:29500"
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1234")
    assert rendezvous.address({}) == "env://127.0.0.1:1234"
    port = free_port()
    closed = rendezvous.probe(f"tcp://127.0.0.1:{port}")
    assert closed is not None
    assert not closed.reachable
    assert (closed.host, closed.port) == ("127.0.0.1", port)
    assert closed.error
    assert "is not reachable" in closed.hint()
    assert rendezvous.probe("file:///tmp/x") is None
    with socket.create_server(("127.0.0.1", 0)) as server:
        open_port = server.getsockname()[1]
        found = rendezvous.probe(f"env://127.0.0.1:{open_port}")
    assert found == rendezvous.Probe("127.0.0.1", open_port, None)
    assert found.hint().endswith("accepts connections, so a peer has not joined yet")
    assert found.hint(2) == found.hint()
    world_one = found.hint(1)  # it said a peer had not joined, at world size 1
    assert "at world size 1 no peer is awaited: torch's init itself has not finished" in world_one
    assert "peer has not joined" not in world_one


@pytest.fixture
def slow_dns(monkeypatch) -> Iterator[list[str]]:
    """``socket.getaddrinfo`` answering no host for 10 s (slow or broken DNS); the hosts asked."""
    asked: list[str] = []
    release = threading.Event()

    def lookup(host: str, *args: object, **kwargs: object) -> list:
        asked.append(host)
        release.wait(10)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    yield asked
    release.set()


def test_probe_bounds_the_host_lookup(slow_dns: list[str]) -> None:
    """Only the connection was bounded (0.5 s): the host lookup before it waited as long as
    DNS took."""
    started = time.monotonic()
    found = rendezvous.probe("tcp://slow.example:29500", timeout=0.2)
    assert time.monotonic() - started < 1.0
    assert found == rendezvous.Probe(
        "slow.example", 29500, "no answer from DNS within 0.2s", resolved=False
    )
    assert found.hint() == (
        "host 'slow.example' does not resolve (no answer from DNS within 0.2s): check the address"
    )


def test_an_init_timeout_probes_the_rendezvous_once_in_time(slow_dns: list[str]) -> None:
    """With slow DNS the ``InitTimeoutError`` came as late as DNS answered, and every later
    read of the default group (each waits again) probed again."""
    handle = mccl.InitHandle(
        "gloo", {"init_method": "tcp://slow.example:29500"}, 0.1, rank=0, world_size=2
    )
    started = time.monotonic()
    for _ in range(3):
        with pytest.raises(mccl.InitTimeoutError, match=r"host 'slow\.example' does not resolve"):
            handle.wait()
    assert time.monotonic() - started < 0.1 + 2  # the README's bound, for all three
    assert slow_dns == ["slow.example"]


@pytest.fixture
def ipv6_port() -> Iterator[int]:
    """The port of a server listening on the IPv6 loopback (skips where there is none)."""
    try:
        server = socket.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    with server:
        yield server.getsockname()[1]


def test_probe_reads_ipv6_hosts_and_trailing_slashes(ipv6_port: int) -> None:
    """``tcp://[::1]:PORT`` was probed with its brackets (a name that resolves to nothing:
    "not reachable, check the address" while the store listened); ``tcp://host:PORT/`` named no
    port at all."""
    port = ipv6_port
    for where in (f"tcp://[::1]:{port}", f"tcp://[::1]:{port}/", f"store [::1]:{port}"):
        found = rendezvous.probe(where)
        assert found == rendezvous.Probe("::1", port, None), where
    assert found.hint().startswith(f"[::1]:{port} accepts connections")
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert rendezvous.probe(f"tcp://127.0.0.1:{port}/").reachable
    assert rendezvous.probe("tcp://127.0.0.1:99999") is None  # no such port


def test_a_raw_ipv6_master_addr_is_read_as_torch_reads_it(monkeypatch, ipv6_port: int) -> None:
    """``MASTER_ADDR=::1`` (torch's env:// takes it) made ``env://::1:PORT``, which names no
    host and port: doctor warned of a bad address and an init's timeout lost its hint."""
    port = ipv6_port
    monkeypatch.setenv("MASTER_ADDR", "::1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    assert rendezvous.address({}) == f"env://[::1]:{port}"
    assert rendezvous.probe(rendezvous.address({})) == rendezvous.Probe("::1", port, None)
    listening = _mccl_checks(monkeypatch, "::1", str(port))["mccl rendezvous"]
    assert (listening.status, listening.detail) == ("ok", f"[::1]:{port} accepts connections")


def _mccl_checks(monkeypatch, addr: str | None, port: str | None) -> dict[str, Check]:
    for name, value in (("MASTER_ADDR", addr), ("MASTER_PORT", port)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    report = Report(quick=True)
    with report.source("mccl"):
        plugin.spore_doctor(report)
    return {c.name: c for c in report.checks}


def test_doctor_names_the_one_rendezvous_variable_that_is_missing(monkeypatch) -> None:
    """With only MASTER_PORT set doctor said "MASTER_ADDR/MASTER_PORT not set"; it names the
    missing one (and the one set), in doctor and in the rendezvous an init error shows."""
    fix = "pass init_method= or store=, or launch with torchrun"
    for addr, port, missing, detail in [
        (
            None,
            "29500",
            "MASTER_ADDR",
            f"MASTER_ADDR not set (MASTER_PORT is '29500'): set MASTER_ADDR, {fix}",
        ),
        (
            "10.0.0.1",
            "",
            "MASTER_PORT",
            f"MASTER_PORT not set (MASTER_ADDR is '10.0.0.1'): set MASTER_PORT, {fix}",
        ),
        ("", None, "MASTER_ADDR and MASTER_PORT", f"MASTER_ADDR and MASTER_PORT not set: {fix}"),
    ]:
        check = _mccl_checks(monkeypatch, addr, port)["mccl rendezvous"]
        assert (check.status, check.detail) == ("info", detail)
        assert rendezvous.address({}) == f"env:// ({missing} unset)"


def test_doctor_rendezvous_check_for_each_state(monkeypatch) -> None:
    checks = _mccl_checks(monkeypatch, None, None)
    assert checks["mccl backends"].status == "ok"
    assert "gloo" in checks["mccl backends"].detail
    assert checks["mccl rendezvous"].status == "info"
    assert "MASTER_ADDR and MASTER_PORT not set" in checks["mccl rendezvous"].detail
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = str(server.getsockname()[1])
        listening = _mccl_checks(monkeypatch, "127.0.0.1", port)["mccl rendezvous"]
    assert (listening.status, listening.detail) == ("ok", f"127.0.0.1:{port} accepts connections")
    closed = _mccl_checks(monkeypatch, "127.0.0.1", str(free_port()))["mccl rendezvous"]
    assert closed.status == "info"
    assert "is not reachable" in closed.detail
    assert "normal on rank 0 before it starts the store" in closed.detail
    unknown = _mccl_checks(monkeypatch, "nosuchhost.invalid", "29500")["mccl rendezvous"]
    assert unknown.status == "warn"  # info: "normal on rank 0 before it starts the store"
    assert unknown.detail.startswith("MASTER_ADDR: host 'nosuchhost.invalid' does not resolve (")
    assert unknown.detail.endswith("): check the address")
    garbled = _mccl_checks(monkeypatch, "127.0.0.1", "port")["mccl rendezvous"]
    assert garbled.status == "warn"
    assert "do not name a host and a port number" in garbled.detail


def test_doctor_reports_backends_and_rendezvous(run_spore) -> None:
    out = run_spore(
        "doctor",
        "--json",
        "--quick",
        env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())},
        timeout=600,
    )
    checks = {c["name"]: c for c in json.loads(out.stdout)["checks"] if c["source"] == "mccl"}
    assert checks["mccl backends"]["status"] == "ok"
    assert "gloo" in checks["mccl backends"]["detail"]
    assert "is not reachable" in checks["mccl rendezvous"]["detail"]


def test_benchmarks_produce_ratios(run_spore) -> None:
    out = run_spore("bench", "mccl", "--json", "--repeat", "1", timeout=600)
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
