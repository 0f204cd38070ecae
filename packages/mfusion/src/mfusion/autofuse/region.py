"""A region: a set of nodes lifted out of a graph into a GraphModule of its own."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch.fx.node import map_arg


def tensor_spec(
    value: torch.Tensor,
) -> tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]:
    """(sizes, strides, dtype, device) of a tensor with static shape."""
    return tuple(value.shape), tuple(value.stride()), value.dtype, value.device


@dataclass(frozen=True)
class Region:
    """``nodes`` in graph order; ``inputs``: the outside nodes they read, by first use;
    ``outputs``: the nodes read outside the region, in graph order."""

    nodes: tuple[torch.fx.Node, ...]
    inputs: tuple[torch.fx.Node, ...]
    outputs: tuple[torch.fx.Node, ...]

    @classmethod
    def of(cls, nodes: Sequence[torch.fx.Node]) -> Region:
        """The region of ``nodes`` (given in graph order)."""
        members = set(nodes)
        inputs: dict[torch.fx.Node, None] = {}
        for node in nodes:
            inputs.update((p, None) for p in node.all_input_nodes if p not in members)
        outputs = tuple(n for n in nodes if any(u not in members for u in n.users))
        return cls(tuple(nodes), tuple(inputs), outputs)

    @cached_property
    def graph_module(self) -> torch.fx.GraphModule:
        """The region as a GraphModule: placeholders ``in0, in1, ...`` (its inputs), nodes
        ``v0, v1, ...`` carrying the original ``meta["val"]``, a tuple of its outputs."""
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for i, node in enumerate(self.inputs):
            env[node] = graph.placeholder(f"in{i}")
            env[node].meta["val"] = node.meta["val"]
        for i, node in enumerate(self.nodes):
            copy = graph.create_node(
                "call_function",
                node.target,
                map_arg(node.args, env.__getitem__),
                map_arg(node.kwargs, env.__getitem__),
                name=f"v{i}",
            )
            copy.meta["val"] = node.meta["val"]
            env[node] = copy
        graph.output(tuple(env[n] for n in self.outputs))
        return torch.fx.GraphModule(torch.nn.Module(), graph, class_name="Region")

    def structural_hash(self) -> str:
        """Equal for regions with the same ops, constants, wiring and input/output tensors."""
        digest = hashlib.sha256(self.graph_module.code.encode())
        for node in (*self.inputs, *self.outputs):
            digest.update(repr(tensor_spec(node.meta["val"])).encode())
        return digest.hexdigest()
