"""The reference region compiler: it runs a region's aten ops one by one, in eager PyTorch.

It shows the protocol at its simplest and lets tests check outlining end to end; it fuses
nothing, so it is never registered by default.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

aten = torch.ops.aten

POINTWISE = (
    aten.add,
    aten.sub,
    aten.mul,
    aten.div,
    aten.neg,
    aten.exp,
    aten.relu,
    aten.sigmoid,
    aten.tanh,
)
FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class EagerRegionCompiler:
    """Supports ``ops`` (op packets) on tensors of ``dtypes``; ``compile`` returns the region
    GraphModule itself. ``compiled`` lists the region graphs it was given, in order."""

    def __init__(
        self,
        name: str = "eager",
        ops: Iterable[Any] = POINTWISE,
        dtypes: Iterable[torch.dtype] = FLOATS,
        version: str = "1",
    ) -> None:
        self.name = name
        self.version = version
        self.ops = frozenset(ops)
        self.dtypes = frozenset(dtypes)
        self.compiled: list[torch.fx.GraphModule] = []

    def supports(self, node: torch.fx.Node) -> bool:
        packet = getattr(node.target, "overloadpacket", None)
        value = node.meta.get("val")
        return packet in self.ops and getattr(value, "dtype", None) in self.dtypes

    def compile(
        self, region_graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]
    ) -> Callable[..., Any]:
        self.compiled.append(region_graph)
        return region_graph

    def __repr__(self) -> str:
        return f"<EagerRegionCompiler {self.name!r}>"
