"""Automatic fusion's planning on synthetic FX graphs: candidates, union-find merging, the cycle
check and the dynamic-programming re-split. No compiles: graphs come from ``make_fx``."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from mfusion.autofuse import fuse
from mfusion.autofuse.candidates import candidate_nodes
from mfusion.autofuse.clustering import Clusters, cluster
from mfusion.autofuse.eager import EagerRegionCompiler
from mfusion.autofuse.placement import has_insertion_point, positions, split

aten = torch.ops.aten


def trace(fn: Callable[..., object], *shapes: tuple[int, ...]) -> torch.fx.GraphModule:
    return make_fx(fn, tracing_mode="fake")(*(torch.randn(s) for s in shapes))


def names(groups: list[list[torch.fx.Node]]) -> list[list[str]]:
    return [[n.name for n in g] for g in groups]


def two_chains(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    c = ((x + 1) * 2).relu()
    m = torch.mm(c, y)  # not supported: splits the graph in two
    return m.neg() + m


def diamond(x: torch.Tensor) -> torch.Tensor:
    a = x.exp()
    u = a.cos()  # not supported, between a and d
    b = a.neg()
    return b + u


def interleaved(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, ...]:
    a = x.exp()
    b = a * 2
    u = b.cos()  # reads b before v, which c needs, is computed
    v = y.cos()
    c = v + b
    d = c.neg()
    w = d.cos()  # reads d before t, which e needs, is computed
    t = z.cos()
    e = d + t
    return u, w, e


def test_candidates_are_the_supported_safe_nodes() -> None:
    gm = trace(lambda x, y: (torch.mm(x + 1, y).sin(), x.bernoulli_(0.5)), (3, 3), (3, 3))
    ops = {str(n.target) for n in candidate_nodes(gm.graph, EagerRegionCompiler())}
    # mm and sin are not in the compiler's op set; bernoulli_ mutates and is random
    assert ops == {"aten.add.Tensor"}


def test_views_are_no_candidates() -> None:
    gm = trace(lambda x: (x * 2).permute(1, 0) + 1, (3, 4))
    compiler = EagerRegionCompiler(ops=[aten.mul, aten.permute, aten.add])
    ops = sorted(str(n.target) for n in candidate_nodes(gm.graph, compiler))
    # the op of a region returns new tensors: a view among its outputs would lose its aliasing
    assert ops == ["aten.add.Tensor", "aten.mul.Tensor"]


def test_candidates_follow_dtypes() -> None:
    gm = make_fx(lambda x, i: (x * 2, i * 2), tracing_mode="fake")(torch.randn(4), torch.arange(4))
    chosen = candidate_nodes(gm.graph, EagerRegionCompiler())
    assert [n.meta["val"].dtype for n in chosen] == [torch.float32]


def test_16_bit_results_are_no_candidates_while_inductor_emulates_eager_casts() -> None:
    """A region computes in float32 between loads and stores; with emulate_precision_casts the
    user asked for eager's rounding of each 16-bit step (a bf16 add + RMSNorm left to dvm was
    up to a bf16 step off eager, plain Inductor exact)."""
    from torch._inductor import config

    def mixed(x: torch.Tensor) -> torch.Tensor:
        y = (x * 2 + 1).float()
        return (y * y).to(torch.bfloat16)

    def chosen() -> list[tuple[str, torch.dtype]]:
        nodes = candidate_nodes(gm.graph, EagerRegionCompiler())
        return sorted((n.name, n.meta["val"].dtype) for n in nodes)

    gm = make_fx(mixed, tracing_mode="fake")(torch.randn(4, dtype=torch.bfloat16))
    bf16, fp32 = torch.bfloat16, torch.float32
    assert chosen() == [("add", bf16), ("mul", bf16), ("mul_1", fp32)]
    with config.patch(emulate_precision_casts=True):
        assert chosen() == [("mul_1", fp32)]


def test_union_find_merges_along_producer_consumer_edges() -> None:
    gm = trace(two_chains, (4, 4), (4, 4))
    regions = cluster(gm.graph, candidate_nodes(gm.graph, EagerRegionCompiler()))
    assert names(regions) == [["add", "mul", "relu"], ["neg", "add_1"]]


def test_merging_across_an_unsupported_node_would_create_a_cycle() -> None:
    gm = trace(diamond, (4,))
    nodes = list(gm.graph.nodes)
    index = {n.name: i for i, n in enumerate(nodes)}
    clusters = Clusters(nodes)
    # exp → cos (not supported) → add: {exp, add} would have a path leaving it and coming back
    assert not clusters.convex_union(index["exp"], index["add"])
    assert clusters.convex_union(index["exp"], index["neg"])
    assert clusters.convex_union(index["neg"], index["add"]) is False
    regions = cluster(gm.graph, candidate_nodes(gm.graph, EagerRegionCompiler()))
    assert names(regions) == [["exp", "neg"]]


def test_a_cycle_through_several_nodes_is_found() -> None:
    def longer(x: torch.Tensor) -> torch.Tensor:
        a = x.exp()
        u = a.cos().sin().cos()  # three unsupported nodes on the way back
        return a.neg() * 2 + u

    gm = trace(longer, (4,))
    regions = cluster(gm.graph, candidate_nodes(gm.graph, EagerRegionCompiler()))
    assert names(regions) == [["exp", "neg", "mul"]]


def test_a_region_with_interleaved_consumers_and_producers_has_no_insertion_point() -> None:
    gm = trace(interleaved, (4,), (4,), (4,))
    regions = cluster(gm.graph, candidate_nodes(gm.graph, EagerRegionCompiler()))
    assert names(regions) == [["exp", "mul", "add", "neg", "add_1"]]
    assert not has_insertion_point(regions[0], positions(gm.graph))


def test_dp_resplits_into_the_fewest_placeable_runs() -> None:
    gm = trace(interleaved, (4,), (4,), (4,))
    (region,) = cluster(gm.graph, candidate_nodes(gm.graph, EagerRegionCompiler()))
    pos = positions(gm.graph)
    runs = split(region, pos)
    # {exp, mul, add} would need v before u; {add, neg, add_1} would need t before w
    assert names(runs) == [["exp", "mul"], ["add", "neg"], ["add_1"]]
    assert all(has_insertion_point(r, pos) for r in runs)
    valid = [
        (i, j)
        for i, j in itertools.combinations(range(1, 5), 2)
        if all(has_insertion_point(p, pos) for p in (region[:i], region[i:j], region[j:]))
    ]
    assert valid == [(2, 4)]  # the split chosen is the only valid one in three runs
    for cut in range(1, 5):  # and no 2-run split is valid
        assert not (
            has_insertion_point(region[:cut], pos) and has_insertion_point(region[cut:], pos)
        )


def test_dp_keeps_a_placeable_region_whole() -> None:
    gm = trace(two_chains, (4, 4), (4, 4))
    first = cluster(gm.graph, candidate_nodes(gm.graph, EagerRegionCompiler()))[0]
    assert split(first, positions(gm.graph)) == [first]


def test_a_ladder_splits_at_every_rung() -> None:
    size = 60

    def ladder(x: torch.Tensor) -> torch.Tensor:
        for _ in range(size):
            x = (x * 2).cos() + x  # cos is not supported: one cycle check per rung
        return x

    gm = trace(ladder, (8,))
    regions = cluster(gm.graph, candidate_nodes(gm.graph, EagerRegionCompiler()))
    # mul_i cannot join add_i (the path through cos leaves and returns), but add_i joins mul_{i+1}
    assert names(regions)[:2] == [["add", "mul_1"], ["add_1", "mul_2"]]
    assert len(regions) == size - 1


def test_fuse_outlines_the_resplit_runs() -> None:
    args = [torch.randn(4) for _ in range(3)]
    gm = make_fx(interleaved, tracing_mode="fake")(*args)
    compiler = EagerRegionCompiler()
    assert fuse(gm, [compiler]) == 2
    assert [
        [str(n.target) for n in region.graph.nodes if n.op == "call_function"]
        for region in compiler.compiled
    ] == [["aten.exp.default", "aten.mul.Tensor"], ["aten.add.Tensor", "aten.neg.default"]]
    left = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert left.count("aten.add.Tensor") == 1  # add_1, alone after the split
    torch.testing.assert_close(gm(*args), interleaved(*args), rtol=0, atol=0)


def test_a_long_zigzag_region_is_cut_at_every_interleaving() -> None:
    steps = 100

    def zigzag(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        outs = []
        for _ in range(steps):
            b = x.exp() * 2
            outs.append(b.cos())  # reads b before y's next cos, which the add below needs
            y = y.cos()
            x = b + y
        return [*outs, x]

    gm = trace(zigzag, (4,), (4,))
    (region,) = cluster(gm.graph, candidate_nodes(gm.graph, EagerRegionCompiler()))
    assert len(region) == 3 * steps
    runs = split(region, positions(gm.graph))
    assert [len(r) for r in runs] == [2] + [3] * (steps - 1) + [1]
    assert [str(n.target) for n in runs[1]] == [
        "aten.add.Tensor",
        "aten.exp.default",
        "aten.mul.Tensor",
    ]
