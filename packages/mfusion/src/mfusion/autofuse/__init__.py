"""Automatic fusion: regions of a post-grad graph compiled by a region compiler, one op each.

Region compilers (:class:`RegionCompiler`) come from plugins, through the
``mfusion_register_region_compilers`` hook, or from :func:`register_region_compiler`. Without
any, automatic fusion leaves the graph to Inductor. With one, the ``autofuse`` pass takes the
``call_function`` nodes it supports, merges them along producer→consumer edges while no cycle
appears (:mod:`~mfusion.autofuse.clustering`), re-splits a region that has no single place in
the graph into the fewest runs that have one (:mod:`~mfusion.autofuse.placement`), and
replaces each region of two or more nodes by one custom op that runs the compiled region
(:mod:`~mfusion.autofuse.outline`, :mod:`~mfusion.autofuse.region_ops`).
"""

from __future__ import annotations

from mfusion.autofuse.fuse import fuse, fuse_with
from mfusion.autofuse.protocol import RegionCompiler
from mfusion.autofuse.registry import (
    RegionCompilerRegistry,
    Registration,
    region_compilers,
    register_region_compiler,
)

__all__ = [
    "RegionCompiler",
    "RegionCompilerRegistry",
    "Registration",
    "fuse",
    "fuse_with",
    "region_compilers",
    "register_region_compiler",
]
