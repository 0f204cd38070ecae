"""sci-protenix's Spore hooks: its benchmarks and the ``spore sci-protenix`` commands."""

from __future__ import annotations

from typing import Any

import spore


@spore.hookimpl
def spore_register_benchmarks(registry: Any) -> None:
    from sci_protenix.benchmarks import benchmarks

    for case in benchmarks():
        registry.add(case)


@spore.hookimpl
def spore_add_commands(cli: Any) -> None:
    from sci_protenix.cli import group

    cli.add_command(group)
