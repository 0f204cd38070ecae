"""dvm as a region compiler for mfusion's automatic fusion.

:class:`DvmRegionCompiler` follows ``mfusion.autofuse.RegionCompiler`` by its shape (``name``,
``version``, ``supports``, ``compile``) without importing mfusion, so dvm works where mfusion
is absent. mfusion asks ``supports(node)`` of each candidate node and hands each region it
builds to ``compile``; the result runs the region on dvm's VM.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dvm._version import __version__


class DvmRegionCompiler:
    """Compiles mfusion regions (aten graphs of elementwise, broadcast and row-reduce ops) into
    dvm VM programs."""

    name = "dvm"

    def __init__(self) -> None:
        self.compiled = 0  # regions compiled by this object (each distinct structure once)

    @property
    def version(self) -> str:
        """dvm's version and the VM's ABI: the FX graph cache key changes with either."""
        from dvm._lib import ABI_VERSION

        return f"{__version__}+abi{ABI_VERSION}"

    def supports(self, node: torch.fx.Node) -> bool:
        """Whether dvm can lower ``node`` (see :func:`dvm.lower.unsupported_reason`)."""
        from dvm.lower import unsupported_reason

        return unsupported_reason(node) is None

    def compile(
        self, region_graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]
    ) -> Callable[..., Any]:
        """A callable running ``region_graph`` on the VM (see :func:`dvm.compile.compile_graph`).

        ``ValueError`` when dvm would leave any of the region's ops that run a kernel to eager
        aten (mfusion then leaves the region to Inductor, which fuses it, and logs this
        message); views and constants left to eager (a broadcast of the region's result) cost
        nothing there.
        """
        from dvm.cluster import NO_WORK
        from dvm.compile import compile_graph

        compiled = compile_graph(region_graph, example_inputs)
        kernels = [(n, why) for n, why in compiled.fallbacks if why != NO_WORK]
        if kernels or not compiled.regions:
            left = "; ".join(f"{n.target}: {why}" for n, why in kernels)
            raise ValueError(
                f"dvm leaves {len(kernels)} of the region's ops to eager aten "
                f"({left or 'no VM region formed'})"
            )
        self.compiled += 1
        return compiled


COMPILER = DvmRegionCompiler()
"""The one compiler object of the process (mfusion caches compiled regions per object)."""
