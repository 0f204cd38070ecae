"""mfusion's Spore hooks: its passes for the post-grad stage, the hooks it publishes, its
benchmark cases."""

from __future__ import annotations

from typing import Any

import spore
from mfusion.selection import PREFIX, Switched


@spore.hookimpl
def spore_addhooks(pluginmanager: Any) -> None:
    from mfusion import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


@spore.hookimpl
def spore_register_passes(registry: Any) -> None:
    from mfusion.passes import all_passes

    for pass_ in all_passes():
        registry.add(
            Switched(pass_),
            name=PREFIX + pass_.name,
            stage=getattr(pass_, "stage", "post_grad"),
            priority=pass_.priority,
        )


@spore.hookimpl
def spore_register_benchmarks(registry: Any) -> None:
    from mfusion.benchmarks import benchmarks

    for case in benchmarks():
        registry.add(case)
