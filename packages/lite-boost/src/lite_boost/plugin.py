"""lite-boost's Spore hooks: its hook spec, the attention op and backends, benchmarks, the CLI."""

from __future__ import annotations

from typing import Any

import spore


@spore.hookimpl
def spore_addhooks(pluginmanager: Any) -> None:
    from lite_boost import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


@spore.hookimpl
def spore_register_ops(registry: Any) -> None:
    from lite_boost import backends

    backends.register(registry)


@spore.hookimpl
def spore_register_benchmarks(registry: Any) -> None:
    from lite_boost.benchmarks import benchmarks

    for case in benchmarks():
        registry.add(case)


@spore.hookimpl
def spore_add_commands(cli: Any) -> None:
    from lite_boost.cli import group

    cli.add_command(group)
