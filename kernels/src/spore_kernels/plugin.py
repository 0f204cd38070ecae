"""spore-kernels' Spore hooks: the ops with their kernels (recorded as this plugin's), and the
benchmarks. ``import spore_kernels`` has already defined the ops; see
:mod:`spore_kernels.registration`."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import spore
from spore_kernels import _lib, registration

if TYPE_CHECKING:
    from spore.registry import OpRegistry, Registry


@spore.hookimpl
def spore_register_ops(registry: OpRegistry) -> None:
    if os.environ.get("SPORE_KERNELS_ISA", "").strip():
        _lib.library()  # a build this machine cannot load fails the plugin here, with why
    registration.register(registry)


@spore.hookimpl
def spore_register_benchmarks(registry: Registry) -> None:
    from spore_kernels.benchmarks import benchmarks

    for case in benchmarks():
        registry.add(case)
