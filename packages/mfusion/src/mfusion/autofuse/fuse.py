"""Automatic fusion of a graph: candidates → convex clusters → placeable runs → one op each."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mfusion.autofuse.candidates import candidate_nodes
from mfusion.autofuse.clustering import cluster
from mfusion.autofuse.outline import outline
from mfusion.autofuse.placement import has_insertion_point, positions, split
from mfusion.autofuse.protocol import RegionCompiler

MIN_NODES = 2


def fuse_with(gm: torch.fx.GraphModule, compiler: RegionCompiler) -> int:
    """Outline the regions ``compiler`` supports in ``gm``; the number of regions outlined."""
    graph = gm.graph
    outlined = 0
    for region in cluster(graph, candidate_nodes(graph, compiler)):
        pos = positions(graph)
        runs = [region] if has_insertion_point(region, pos) else split(region, pos)
        for run in runs:
            if len(run) >= MIN_NODES and outline(gm, run, compiler):
                outlined += 1
    return outlined


def fuse(gm: torch.fx.GraphModule, compilers: Sequence[RegionCompiler]) -> int:
    """Give each compiler in turn the nodes still left; the number of regions outlined
    (``0``, graph untouched, without compilers)."""
    outlined = sum(fuse_with(gm, compiler) for compiler in compilers)
    if outlined:
        gm.graph.lint()
        gm.recompile()
    return outlined
