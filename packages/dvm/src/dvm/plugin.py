"""dvm's Spore hooks: the ``dvm`` compile backend, the region compiler mfusion's automatic
fusion hands regions to (when mfusion is installed), and the ``spore bench dvm`` cases.

Nothing here imports mfusion: the region compiler follows mfusion's protocol by its shape.
"""

from __future__ import annotations

from typing import Any

import spore


@spore.hookimpl
def spore_register_backends(registry: Any) -> None:
    from dvm.backend import dvm_backend
    from spore.backends import Backend

    registry.add(
        Backend(
            "dvm",
            dvm_backend,
            description="AOT autograd; elementwise/broadcast/row-reduce regions of the forward "
            "and backward graphs run on dvm's fused-kernel VM, the rest as eager aten",
        )
    )


@spore.hookimpl(optionalhook=True)
def mfusion_register_region_compilers(registry: Any) -> None:
    from dvm.region_compiler import COMPILER

    registry.add(COMPILER)


@spore.hookimpl
def spore_register_benchmarks(registry: Any) -> None:
    from dvm.benchmarks import benchmarks

    for case in benchmarks():
        registry.add(case)
