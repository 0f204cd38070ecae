"""Replacing a region's nodes in the graph by one call of its compiled op."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from mfusion.autofuse.candidates import is_barrier
from mfusion.autofuse.placement import bounds, positions
from mfusion.autofuse.protocol import RegionCompiler
from mfusion.autofuse.region import Region
from mfusion.autofuse.region_ops import region_op


def outline(
    gm: torch.fx.GraphModule, nodes: Sequence[torch.fx.Node], compiler: RegionCompiler
) -> bool:
    """Replace ``nodes`` (graph order, with an insertion point, no side effect among them) by
    one op ``compiler`` compiled; the op goes right after the last node it reads (or the last
    side effect before the region), its outputs are read through ``getitem``. ``False``
    (graph unchanged) when the compile failed or nothing reads the region."""
    graph = gm.graph
    order = list(graph.nodes)
    pos = positions(graph)
    last, first = bounds(nodes, pos)
    if not last < first:  # a run from split() keeps its insertion point; this guards the rule
        return False
    region = Region.of(nodes)
    if not region.outputs:  # dead code, which Inductor drops: nothing to compile
        return False
    op = region_op(compiler, region)
    if op is None:
        return False
    # after its inputs, the placeholders and the last side effect before the region
    start = pos[nodes[0]]
    anchor = max(
        [last, *(i for i, n in enumerate(order[:start]) if n.op == "placeholder" or is_barrier(n))]
    )
    values = [n.meta["val"] for n in region.outputs]
    with graph.inserting_after(order[anchor]):
        call = graph.call_function(op, tuple(region.inputs))
    call.meta["val"] = values[0] if len(values) == 1 else tuple(values)
    replacements = [call]
    if len(values) > 1:
        replacements = []
        previous = call
        for i, value in enumerate(values):
            with graph.inserting_after(previous):
                previous = graph.call_function(operator.getitem, (call, i))
            previous.meta["val"] = value
            replacements.append(previous)
    members = set(nodes)
    for old, new in zip(region.outputs, replacements, strict=True):
        old.replace_all_uses_with(new, delete_user_cb=lambda user: user not in members)
    for node in reversed(nodes):
        graph.erase_node(node)
    return True
