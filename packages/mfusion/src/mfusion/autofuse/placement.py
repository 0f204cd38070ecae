"""Where a region's op can go, and the dynamic-programming re-split of regions with no place.

The graph keeps its node order: a region's nodes are replaced by one op at a single point,
after the last node producing one of its inputs and before the first node consuming one of
its outputs. A region whose consumers and producers interleave (a consumer of its outputs
comes before a producer of its inputs) has no such point; :func:`split` then cuts its nodes,
in graph order, into the fewest contiguous runs that each have one.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import torch


def positions(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    """Each node's index in graph order."""
    return {n: i for i, n in enumerate(graph.nodes)}


def bounds(nodes: Sequence[torch.fx.Node], pos: dict[torch.fx.Node, int]) -> tuple[int, float]:
    """(position of the last outside producer of an input, of the first outside consumer of an
    output); ``-1`` and ``inf`` when there are none."""
    members = set(nodes)
    last = max((pos[p] for n in nodes for p in n.all_input_nodes if p not in members), default=-1)
    first = min((pos[u] for n in nodes for u in n.users if u not in members), default=math.inf)
    return last, first


def has_insertion_point(nodes: Sequence[torch.fx.Node], pos: dict[torch.fx.Node, int]) -> bool:
    """Whether one op can replace ``nodes`` without moving any other node."""
    last, first = bounds(nodes, pos)
    return last < first


def split(
    nodes: Sequence[torch.fx.Node], pos: dict[torch.fx.Node, int]
) -> list[list[torch.fx.Node]]:
    """Cut ``nodes`` (graph order) into the fewest contiguous runs that each have an insertion
    point; among equally few, the one leaving fewest nodes alone in a run of one.

    ``best[k]`` is the best cut of ``nodes[:k]``, final once every shorter prefix has been
    extended; a run from ``j`` stops growing once a node outside the region reads it before
    the last input it needs is produced (no longer run from ``j`` can have a place then).
    """
    region = set(nodes)
    best: list[tuple[int, int, int] | None] = [(0, 0, -1)] + [None] * len(nodes)
    for j in range(len(nodes)):
        runs, alone, _ = best[j]  # type: ignore[misc]
        inside: set[int] = set()
        last, outside_first = -1, math.inf
        consumers: list[int] = []  # a heap; members that joined later are dropped lazily
        for k in range(j, len(nodes)):
            node = nodes[k]
            inside.add(pos[node])
            for producer in node.all_input_nodes:
                if pos[producer] not in inside:
                    last = max(last, pos[producer])
            for user in node.users:
                heapq.heappush(consumers, pos[user])
                if user not in region:
                    outside_first = min(outside_first, pos[user])
            if last >= outside_first:
                break
            while consumers and consumers[0] in inside:
                heapq.heappop(consumers)
            if last < (consumers[0] if consumers else math.inf):
                candidate = (runs + 1, alone + (k == j), j)
                held = best[k + 1]
                if held is None or candidate[:2] < held[:2]:
                    best[k + 1] = candidate
    cut: list[list[torch.fx.Node]] = []
    k = len(nodes)
    while k > 0:
        j = best[k][2]  # type: ignore[index]
        cut.append(list(nodes[j:k]))
        k = j
    return cut[::-1]
