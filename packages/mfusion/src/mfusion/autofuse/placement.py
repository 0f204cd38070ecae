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


def _valid_runs(nodes: Sequence[torch.fx.Node], pos: dict[torch.fx.Node, int]) -> list[list[bool]]:
    """``ok[j][k]``: the run ``nodes[j:k+1]`` has an insertion point; one sweep per start."""
    ok = [[False] * len(nodes) for _ in nodes]
    for j in range(len(nodes)):
        inside: set[int] = set()
        last = -1
        consumers: list[int] = []  # a heap; members that joined later are dropped lazily
        for k in range(j, len(nodes)):
            node = nodes[k]
            inside.add(pos[node])
            for producer in node.all_input_nodes:
                if pos[producer] not in inside:
                    last = max(last, pos[producer])
            for user in node.users:
                heapq.heappush(consumers, pos[user])
            while consumers and consumers[0] in inside:
                heapq.heappop(consumers)
            ok[j][k] = last < (consumers[0] if consumers else math.inf)
    return ok


def split(
    nodes: Sequence[torch.fx.Node], pos: dict[torch.fx.Node, int]
) -> list[list[torch.fx.Node]]:
    """Cut ``nodes`` (graph order) into the fewest contiguous runs that each have an insertion
    point; among equally few, the one leaving fewest nodes alone in a run of one."""
    ok = _valid_runs(nodes, pos)
    best: list[tuple[int, int, int]] = [(0, 0, -1)]  # (runs, nodes left alone, start of last)
    for k in range(len(nodes)):
        best.append(
            min((best[j][0] + 1, best[j][1] + (j == k), j) for j in range(k + 1) if ok[j][k])
        )
    runs: list[list[torch.fx.Node]] = []
    k = len(nodes)
    while k > 0:
        j = best[k][2]
        runs.append(list(nodes[j:k]))
        k = j
    return runs[::-1]
