"""hyperparallel's Spore hooks: the ``spore train`` command and its benchmark."""

from __future__ import annotations

import click

import spore
from spore.registry import Registry


@spore.hookimpl
def spore_add_commands(cli: click.Group) -> None:
    from hyperparallel.cli import train

    cli.add_command(train)


@spore.hookimpl
def spore_register_benchmarks(registry: Registry) -> None:
    from hyperparallel.benchmarks import benchmarks

    for case in benchmarks():
        registry.add(case)
