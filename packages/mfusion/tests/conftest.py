"""Shared fixtures: a private Inductor cache, compiling with mfusion while recording graphs (and
rerunning passes inside the compile), and the relative-tolerance comparison with eager."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import pytest
import torch

RECORDER_PRIORITY = -(10**9)  # after every other pass, autofusion included
RERUN_PRIORITY = 1  # after every hand-written pass (the lowest is 5), before autofusion (-1000)
#: largest absolute difference allowed, over the largest absolute expected value; each test
#: module's docstring says why its dtypes' bounds hold
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: the long model matrix; run by `nox -s mfusion_full`, not by default"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without ``-m``, deselect the ``slow`` tests (``-m slow`` runs them)."""
    if config.option.markexpr:
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


@pytest.fixture(autouse=True)
def every_pass_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests run on CPU and check every rewrite, so the passes that leave CPU graphs to
    Inductor by default run there too (test_selection.py tests that default)."""
    monkeypatch.setenv("MFUSION_CPU", "all")


@pytest.fixture(autouse=True)
def inductor_cache(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    """Every test compiles into a cache folder of its own and starts from a reset dynamo."""
    folder = str(tmp_path_factory.mktemp("inductor-cache"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", folder)
    torch._dynamo.reset()
    yield folder
    torch._dynamo.reset()


class Rerun(NamedTuple):
    """What running passes a second time did to one compiled post-grad graph."""

    rewrites: list[int]  # per pass, in the order given
    spore_ops: dict[str, int]  # the graph's spore ops after the second run
    unchanged: bool  # the graph's node targets are the same as before it


@dataclass
class Compiled:
    """What a compile with mfusion produced: outputs, each post-grad graph's op counts and,
    when passes were rerun, what the second run did to each graph."""

    outputs: Any
    graphs: list[collections.Counter[str]] = field(default_factory=list)
    reruns: list[Rerun] = field(default_factory=list)

    def count(self, op: str, graph: int | None = None) -> int:
        """How often ``op`` (e.g. ``"spore.rms_norm.default"``) occurs in one graph or all."""
        chosen = self.graphs if graph is None else [self.graphs[graph]]
        return sum(c[op] for c in chosen)

    def spore_ops(self, graph: int | None = None) -> dict[str, int]:
        """Every ``torch.ops.spore.*`` overload in one graph (or all) with its count."""
        chosen = self.graphs if graph is None else [self.graphs[graph]]
        total: collections.Counter[str] = collections.Counter()
        for counts in chosen:
            total.update(_spore_ops(counts))
        return dict(total)


def _op_counts(gm: torch.fx.GraphModule) -> collections.Counter[str]:
    return collections.Counter(
        str(node.target) for node in gm.graph.nodes if node.op == "call_function"
    )


def _spore_ops(counts: collections.Counter[str]) -> dict[str, int]:
    return {k: v for k, v in counts.items() if k.startswith("spore.")}


@pytest.fixture
def mfusion_compile(spore_manager: Any) -> Callable[..., Compiled]:
    """``mfusion_compile(fn, *args, env=None, rerun=())``: ``torch.compile(fn, backend="spore")``
    in a fresh plugin manager, called on ``args``; records every post-grad graph after the passes
    (forward first, then backward when the caller runs one). The manager loads mfusion alone
    unless ``env`` (``SPORE_*`` variables) says otherwise, so another installed plugin (dvm's
    region compiler, say) does not change what the tests count. With ``rerun`` (passes), each
    post-grad graph goes through them again after every hand-written pass, and ``reruns`` says
    what that second run did (idempotence inside a real compile)."""

    def run(
        fn: Callable[..., Any],
        *args: Any,
        env: dict[str, str] | None = None,
        rerun: Sequence[Callable[[torch.fx.GraphModule], int]] = (),
    ) -> Compiled:
        manager = spore_manager({"SPORE_PLUGINS": "mfusion"} if env is None else env)
        result = Compiled(outputs=None)

        def record(gm: torch.fx.GraphModule) -> int:
            result.graphs.append(_op_counts(gm))
            return 0

        def again(gm: torch.fx.GraphModule) -> int:
            before = [str(n.target) for n in gm.graph.nodes]
            rewrites = [int(pass_(gm) or 0) for pass_ in rerun]
            after = [str(n.target) for n in gm.graph.nodes]
            result.reruns.append(Rerun(rewrites, _spore_ops(_op_counts(gm)), after == before))
            return 0

        passes = manager.registry("passes")
        passes.add(record, name="test.recorder", stage="post_grad", priority=RECORDER_PRIORITY)
        if rerun:
            passes.add(again, name="test.rerun", stage="post_grad", priority=RERUN_PRIORITY)
        torch._dynamo.reset()
        result.outputs = torch.compile(fn, backend="spore")(*args)
        return result

    return run


def _assert_rel_close(got: torch.Tensor, want: torch.Tensor, what: str = "output") -> None:
    assert got.dtype == want.dtype, what
    assert got.shape == want.shape, what
    finite = want.isfinite()
    torch.testing.assert_close(
        got[~finite],
        want[~finite],
        rtol=0,
        atol=0,
        equal_nan=True,
        msg=lambda detail: f"{what}: not eager's ±inf/NaN where it has them: {detail}",
    )
    if not finite.any():
        return  # empty or all ±inf/NaN: nothing more to compare
    rel = TOLERANCE[want.dtype]
    got, want = got[finite].float(), want[finite].float()
    tol = rel * want.abs().max().item()
    err = (got - want).abs().max().item()  # inf or NaN where got is not finite: fails
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol:.3g}"


@pytest.fixture
def assert_rel_close() -> Callable[..., None]:
    """``assert_rel_close(got, want, what="output")``: the same dtype and shape, ``want``'s ±inf
    and NaN at the same places, and elsewhere the largest absolute difference at most
    ``TOLERANCE[dtype]`` times the largest absolute finite ``want``."""
    return _assert_rel_close


@pytest.fixture
def only_autofuse() -> Iterator[None]:
    """mfusion's hand-written passes off, so the graphs show automatic fusion alone."""
    import mfusion
    from mfusion.selection import reset

    mfusion.disable_passes(*(n for n in mfusion.pass_names() if n != "autofuse"))
    yield
    reset()
