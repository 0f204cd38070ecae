"""``spore ops``, ``spore passes`` and ``spore backends``: what the plugins registered."""

from __future__ import annotations

from typing import Any

import click

from spore.cli.render import Column, emit
from spore.plugins import get_manager

JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


def _kernels_cell(row: dict[str, Any]) -> str:
    cells = [
        f"{device}: " + ", ".join(f"{k['provider']} ({k['priority']})" for k in kernels)
        for device, kernels in row["kernels"].items()
    ]
    return "; ".join(cells) or "reference only"


@click.command("ops")
@JSON_OPTION
def ops_cmd(as_json: bool) -> None:
    """List the ops plugins defined and the kernels per device, in the order they are tried.

    Which kernel runs is decided per call by each kernel's supports() predicate; in Python,
    spore.dispatch.explain(op, *args) says which would run for given arguments and why.
    """
    registry = get_manager().registry("ops")
    rows = []
    for entry in registry.entries():
        if not hasattr(entry.value, "candidates"):
            continue
        op = entry.value
        devices = sorted({device for device, _ in op.kernels})
        rows.append(
            {
                "op": f"spore::{op.name}",
                "schema": op.schema,
                "defined_by": entry.owner,
                "kernels": {
                    device: [
                        {"provider": k.provider, "priority": k.priority}
                        for k in op.candidates(device)
                    ]
                    for device in devices
                },
            }
        )
    emit(
        rows,
        as_json=as_json,
        empty="No spore ops defined (plugins define them through spore_register_ops).",
        title="spore ops (kernels in the order tried; else the reference)",
        columns=[
            Column("op", lambda r: r["op"], "name"),
            Column("defined by", lambda r: r["defined_by"], "name"),
            Column("kernels", _kernels_cell),
            Column("schema", lambda r: r["schema"], "note"),
        ],
    )


@click.command("passes")
@JSON_OPTION
def passes_cmd(as_json: bool) -> None:
    """List the graph passes registered through Spore: stage, priority, device, owner."""
    registry = get_manager().registry("passes")
    rows = [
        {
            "name": e.name,
            "stage": e.value.stage,
            "priority": e.value.priority,
            "device": e.value.device,
            "version": e.value.version,
            "registered_by": e.owner,
        }
        for e in sorted(registry.entries(), key=lambda e: (e.value.stage, -e.value.priority))
    ]
    emit(
        rows,
        as_json=as_json,
        empty="No graph passes registered (see docs/core/passes.md).",
        title="spore passes (per stage, in the order they run)",
        columns=[
            Column("stage", lambda r: r["stage"], "name"),
            Column("name", lambda r: r["name"], "name"),
            Column("priority", lambda r: str(r["priority"])),
            Column("device", lambda r: r["device"] or "any"),
            Column("version", lambda r: r["version"]),
            Column("registered by", lambda r: r["registered_by"], "name"),
        ],
    )


@click.command("backends")
@JSON_OPTION
def backends_cmd(as_json: bool) -> None:
    """List the torch.compile backends registered through Spore, and by whom."""
    registry = get_manager().registry("backends")
    rows = [
        {
            "name": e.name,
            "registered_by": e.owner,
            "fallback": e.value.fallback,
            "description": e.value.description,
        }
        for e in registry.entries()
    ]
    emit(
        rows,
        as_json=as_json,
        empty="No backends registered through Spore (torch's own: torch._dynamo.list_backends()).",
        title="spore backends (torch.compile(model, backend=NAME))",
        columns=[
            Column("name", lambda r: r["name"], "name"),
            Column("registered by", lambda r: r["registered_by"], "name"),
            Column("fallback to eager", lambda r: str(r["fallback"])),
            Column("description", lambda r: r["description"]),
        ],
    )
