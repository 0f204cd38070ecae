"""Union-find clustering of candidate nodes along producer→consumer edges, with a cycle check.

Only nodes between the same two side-effect nodes (see
:func:`~mfusion.autofuse.candidates.is_barrier`) merge, so no region moves a read across a
mutation. Two clusters merge only if the merged one stays convex: no path leaves it and comes
back (such a region could not run as one op). With ``desc``/``anc`` the descendants/ancestors
of a cluster as bit sets over graph positions, the merged cluster ``M`` is convex exactly when
``desc(M) & anc(M)`` lies inside ``M``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mfusion.autofuse.candidates import is_barrier


def reachability(nodes: list[torch.fx.Node]) -> tuple[list[int], list[int]]:
    """Descendant and ancestor bit sets of each node (bit ``i`` is ``nodes[i]``, a topological
    order), the node itself excluded."""
    index = {n: i for i, n in enumerate(nodes)}
    desc = [0] * len(nodes)
    anc = [0] * len(nodes)
    for i in range(len(nodes) - 1, -1, -1):
        for user in nodes[i].users:
            j = index[user]
            desc[i] |= desc[j] | (1 << j)
    for i, node in enumerate(nodes):
        for producer in node.all_input_nodes:
            j = index[producer]
            anc[i] |= anc[j] | (1 << j)
    return desc, anc


class Clusters:
    """Union-find over graph positions; each root holds its members, descendants and
    ancestors as bit sets."""

    def __init__(self, nodes: list[torch.fx.Node]) -> None:
        self.down, self.up = reachability(nodes)
        self.parent = list(range(len(nodes)))
        self.members = [1 << i for i in range(len(nodes))]

    def find(self, i: int) -> int:
        root = i
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[i] != root:
            self.parent[i], i = root, self.parent[i]
        return root

    def convex_union(self, a: int, b: int) -> bool:
        """Merge the clusters of ``a`` and ``b`` unless that creates a cycle; whether merged."""
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return True
        members = self.members[ra] | self.members[rb]
        down = self.down[ra] | self.down[rb]
        up = self.up[ra] | self.up[rb]
        if down & up & ~members:
            return False
        if self.members[ra].bit_count() < self.members[rb].bit_count():
            ra, rb = rb, ra
        self.parent[rb] = ra
        self.members[ra], self.down[ra], self.up[ra] = members, down, up
        return True

    def groups(self, chosen: Iterable[int]) -> list[list[int]]:
        """The clusters of ``chosen`` positions, each sorted, ordered by first position."""
        found: dict[int, list[int]] = {}
        for i in sorted(chosen):
            found.setdefault(self.find(i), []).append(i)
        return sorted(found.values(), key=lambda g: g[0])


def cluster(graph: torch.fx.Graph, candidates: set[torch.fx.Node]) -> list[list[torch.fx.Node]]:
    """Regions of two or more candidates, merged along producer→consumer edges in graph order
    while convex and between the same side-effect nodes; each region in graph order, regions by
    first node."""
    nodes = list(graph.nodes)
    clusters = Clusters(nodes)
    index = {n: i for i, n in enumerate(nodes)}
    segment: dict[torch.fx.Node, int] = {}
    barriers = 0
    for node in nodes:
        barriers += is_barrier(node)
        segment[node] = barriers
        if node not in candidates:
            continue
        for producer in node.all_input_nodes:
            if producer in candidates and segment[producer] == barriers:
                clusters.convex_union(index[producer], index[node])
    groups = clusters.groups(index[n] for n in candidates)
    return [[nodes[i] for i in g] for g in groups if len(g) >= 2]
