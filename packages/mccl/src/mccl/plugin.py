"""mccl's Spore hooks: the async init for `spore_init_process_group`, doctor checks, benchmarks."""

from __future__ import annotations

import os
from typing import Any

import spore
from mccl import rendezvous
from spore.bench import Benchmark
from spore.doctor import Report
from spore.registry import Registry


@spore.hookimpl
def spore_init_process_group(backend: str | None, options: dict[str, Any]) -> Any:
    from mccl.init import init_process_group_async

    return init_process_group_async(backend, **options)


@spore.hookimpl
def spore_doctor(report: Report) -> None:
    import torch.distributed as dist

    if not dist.is_available():
        report.add("mccl backends", "error", "this torch build has no torch.distributed")
        return
    found = {
        name: check()
        for name, check in (
            ("gloo", dist.is_gloo_available),
            ("nccl", dist.is_nccl_available),
            ("mpi", dist.is_mpi_available),
            ("ucc", dist.is_ucc_available),
        )
    }
    available = [name for name, ok in found.items() if ok] or ["none"]
    report.add("mccl backends", "ok" if found["gloo"] else "warn", ", ".join(available))
    unset = rendezvous.unset_master()
    if unset:
        fix = "pass init_method= or store=, or launch with torchrun"
        if len(unset) == 1:  # the other one is set: name both
            (given,) = (name for name in rendezvous.MASTER if name not in unset)
            detail = f"{unset[0]} not set ({given} is {os.environ[given]!r}): set {unset[0]}, {fix}"
        else:
            detail = f"{' and '.join(unset)} not set: {fix}"
        report.add("mccl rendezvous", "info", detail)
        return
    host, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    found = rendezvous.probe(rendezvous.address({}))
    if found is None:
        report.add(
            "mccl rendezvous",
            "warn",
            f"MASTER_ADDR/MASTER_PORT ({host}:{port}) do not name a host and a port number",
        )
    elif not found.resolved:
        report.add("mccl rendezvous", "warn", f"MASTER_ADDR: {found.hint()}")
    elif found.reachable:
        where = rendezvous.host_port(found.host, found.port)
        report.add("mccl rendezvous", "ok", f"{where} accepts connections")
    else:
        report.add(
            "mccl rendezvous",
            "info",
            f"{rendezvous.host_port(found.host, found.port)} is not reachable ({found.error}): "
            "normal on rank 0 "
            "before it starts the store, else check the address",
        )


@spore.hookimpl
def spore_register_benchmarks(registry: Registry[Benchmark]) -> None:
    from mccl.benchmarks import benchmarks

    for case in benchmarks():
        registry.add(case)
