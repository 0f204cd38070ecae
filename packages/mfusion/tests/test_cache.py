"""Inductor's FX graph cache with mfusion, and a user's own post-grad pass beside mfusion's.

A compile the cache serves runs no pass: no post-grad graph is recorded and ``stats()`` stays
empty. A hit needs the same passes at the same versions; switching one off changes its version
(:class:`mfusion.selection.Switched`), so the next compile misses.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

import mfusion
import spore
from mfusion import selection
from spore import childproc, passes
from spore.testing import clean_environ

SILU_MUL = "spore.silu_mul.default"
CHILD_TIMEOUT_S = 600


def gated_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Llama's MLP gate: one SiLU·mul for mfusion to fuse."""
    return F.silu(x @ gate) * (x @ up)


def _inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(shape, generator=g) for shape in ((8, 16), (16, 32), (16, 32)))


def _cache() -> tuple[int, int]:
    """(hits, misses) of the FX graph cache since the test started."""
    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The FX graph cache on, no switched-off pass, counters from zero."""
    monkeypatch.delenv(selection.ENV, raising=False)
    selection.reset()
    counters.clear()
    with torch._inductor.config.patch(fx_graph_cache=True):
        yield
    selection.reset()


def test_a_recompile_hits_the_cache_and_runs_no_pass(mfusion_compile: Any) -> None:
    args = _inputs()
    first = mfusion_compile(gated_mlp, *args)
    assert first.count(SILU_MUL) == 1
    assert _cache() == (0, 1)

    again = mfusion_compile(gated_mlp, *args)  # after torch._dynamo.reset(), same cache folder
    assert _cache() == (1, 1)
    assert again.graphs == [], "a cache hit runs no post-grad pass"
    assert torch.equal(again.outputs, first.outputs)
    torch.testing.assert_close(again.outputs, gated_mlp(*args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("switch", ["environment", "api"])
def test_switching_a_pass_off_misses_the_cache_and_back_on_hits(
    switch: str, mfusion_compile: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = _inputs()
    assert mfusion_compile(gated_mlp, *args).count(SILU_MUL) == 1
    assert _cache() == (0, 1)

    if switch == "environment":
        monkeypatch.setenv(selection.ENV, "silu_mul")
    else:
        mfusion.disable_passes("silu_mul")
    off = mfusion_compile(gated_mlp, *args)
    assert _cache() == (0, 2), "a switched-off pass must not be served the rewritten graph"
    assert len(off.graphs) == 1
    assert off.count(SILU_MUL) == 0
    torch.testing.assert_close(off.outputs, gated_mlp(*args), rtol=1e-5, atol=1e-5)

    monkeypatch.delenv(selection.ENV, raising=False)
    mfusion.enable_passes("silu_mul")
    back = mfusion_compile(gated_mlp, *args)
    assert _cache() == (1, 2)
    assert back.graphs == []


def test_another_spore_kernels_release_misses_the_cache(
    mfusion_compile: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the fused ops' fakes (the strides a cached graph asserts) come with spore-kernels
    import spore_kernels

    args = _inputs()
    assert mfusion_compile(gated_mlp, *args).count(SILU_MUL) == 1
    monkeypatch.setattr(spore_kernels, "__version__", f"{spore_kernels.__version__}.post1")
    upgraded = mfusion_compile(gated_mlp, *args)
    assert _cache() == (0, 2), "a graph rewritten for another release's ops must not be served"
    assert upgraded.count(SILU_MUL) == 1


CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    import torch.nn.functional as F
    from torch._dynamo.utils import counters
    import mfusion
    from spore import passes

    def gated_mlp(x, gate, up):
        return F.silu(x @ gate) * (x @ up)

    if "off" in sys.argv[1:]:
        mfusion.disable_passes("silu_mul")
    if "compiler" in sys.argv[1:]:  # a region compiler active, as dvm's when installed
        from mfusion.autofuse import register_region_compiler
        from mfusion.autofuse.eager import EagerRegionCompiler

        register_region_compiler(EagerRegionCompiler("child"))
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(s, generator=g) for s in ((8, 16), (16, 32), (16, 32))]
    out = torch.compile(gated_mlp, backend="spore")(*args)
    torch.testing.assert_close(out, gated_mlp(*args), rtol=1e-5, atol=1e-5)
    print(json.dumps({
        "hit": counters["inductor"]["fxgraph_cache_hit"],
        "miss": counters["inductor"]["fxgraph_cache_miss"],
        "bypass": counters["inductor"]["fxgraph_cache_bypass"],
        "silu_mul": passes.stats().get("mfusion.silu_mul"),
    }))
    """
)


def test_a_fresh_process_hits_the_cache_and_a_switched_off_pass_misses(
    inductor_cache: str,
) -> None:
    # mfusion alone (without a region compiler: see the next test)
    env = clean_environ({"TORCHINDUCTOR_CACHE_DIR": inductor_cache, "SPORE_PLUGINS": "mfusion"})
    env.pop(selection.ENV, None)
    env["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "1"
    plain = [sys.executable, "-c", CHILD]
    first = childproc.run_json(plain, env=env, timeout=CHILD_TIMEOUT_S)
    assert first == {"hit": 0, "miss": 1, "bypass": 0, "silu_mul": 1}
    again, off = childproc.run_json_all([plain, [*plain, "off"]], env=env, timeout=CHILD_TIMEOUT_S)
    assert again == {"hit": 1, "miss": 0, "bypass": 0, "silu_mul": None}, "a hit runs no pass"
    assert off == {"hit": 0, "miss": 1, "bypass": 0, "silu_mul": 0}


def test_an_active_region_compiler_bypasses_the_cache_only_where_autofuse_runs(
    inductor_cache: str,
) -> None:
    """Outlined regions are ops of their process only. On CPU graphs autofuse runs only when
    forced: otherwise a fresh process with a compiler active still hits the cache."""
    env = clean_environ({"TORCHINDUCTOR_CACHE_DIR": inductor_cache, "SPORE_PLUGINS": "mfusion"})
    env.pop(selection.ENV, None)
    env.pop(selection.CPU_ENV, None)
    env["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "1"
    child = [sys.executable, "-c", CHILD, "compiler"]
    first = childproc.run_json(child, env=env, timeout=CHILD_TIMEOUT_S)
    assert first == {"hit": 0, "miss": 1, "bypass": 0, "silu_mul": 1}
    forced = {**env, selection.CPU_ENV: "autofuse"}
    again = childproc.run_json(child, env=env, timeout=CHILD_TIMEOUT_S)
    outlined = childproc.run_json(child, env=forced, timeout=CHILD_TIMEOUT_S)
    assert again == {"hit": 1, "miss": 0, "bypass": 0, "silu_mul": None}
    assert outlined["hit"] == 0
    assert outlined["bypass"] == 1


class UserPass(CustomGraphPass):
    """A user's own post-grad pass: records the spore ops of each graph it sees."""

    def __init__(self, tag: str = "1") -> None:
        self.tag = tag
        self.seen: list[int] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.seen.append(sum(str(n.target) == SILU_MUL for n in graph.nodes))

    def uuid(self) -> Any:
        return f"user-pass-{self.tag}"


def test_a_pass_in_inductors_slot_runs_before_mfusions_and_keys_the_cache(
    mfusion_compile: Any,
) -> None:
    config = torch._inductor.config
    user = UserPass()
    args = _inputs()
    with config.patch(post_grad_custom_post_pass=user):
        compiled = mfusion_compile(gated_mlp, *args)
        assert config.post_grad_custom_post_pass is user, "backend='spore' leaves the slot"
    assert user.seen == [0], "the user's pass runs once, chained before mfusion's passes"
    assert compiled.count(SILU_MUL) == 1

    changed = UserPass("2")
    with config.patch(post_grad_custom_post_pass=changed):
        mfusion_compile(gated_mlp, *args)
    assert changed.seen == [0]
    assert _cache() == (0, 2), "another user pass (uuid) is another cache entry"


def test_enable_chains_the_users_pass_in_a_plain_compile(spore_manager: Any) -> None:
    config = torch._inductor.config
    user = UserPass()
    spore_manager()
    args = _inputs()
    torch._dynamo.reset()
    slots = {slot: getattr(config, slot) for slot in passes.STAGES.values()}  # restored after
    with config.patch({**slots, "post_grad_custom_post_pass": user}):
        mfusion.enable()
        out = torch.compile(gated_mlp)(*args)
    torch.testing.assert_close(out, gated_mlp(*args), rtol=1e-5, atol=1e-5)
    assert user.seen == [0]
    assert passes.stats()["mfusion.silu_mul"] == 1


def test_a_registered_user_pass_runs_among_mfusions_by_priority(spore_manager: Any) -> None:
    spore_manager()
    user = UserPass()

    def after_silu_mul(gm: torch.fx.GraphModule) -> int:
        user(gm.graph)
        return 0

    spore.register_custom_pass(after_silu_mul, name="user.after", priority=-1)
    args = _inputs()
    torch._dynamo.reset()
    out = torch.compile(gated_mlp, backend="spore")(*args)
    torch.testing.assert_close(out, gated_mlp(*args), rtol=1e-5, atol=1e-5)
    assert user.seen == [1], "priority -1 runs after silu_mul (40) and sees its rewrite"
    assert passes.stats()["mfusion.silu_mul"] == 1
    assert passes.stats()["user.after"] == 0
