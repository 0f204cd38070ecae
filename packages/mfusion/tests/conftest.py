"""Shared fixtures: a private Inductor cache, and compiling with mfusion while recording graphs."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

RECORDER_PRIORITY = -(10**9)  # after every other pass, autofusion included


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
def inductor_cache(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    """Every test compiles into a cache folder of its own and starts from a reset dynamo."""
    folder = str(tmp_path_factory.mktemp("inductor-cache"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", folder)
    torch._dynamo.reset()
    yield folder
    torch._dynamo.reset()


@dataclass
class Compiled:
    """What a compile with mfusion produced: outputs and each post-grad graph's op counts."""

    outputs: Any
    graphs: list[collections.Counter[str]] = field(default_factory=list)

    def count(self, op: str, graph: int | None = None) -> int:
        """How often ``op`` (e.g. ``"spore.rms_norm.default"``) occurs in one graph or all."""
        chosen = self.graphs if graph is None else [self.graphs[graph]]
        return sum(c[op] for c in chosen)

    def spore_ops(self, graph: int | None = None) -> dict[str, int]:
        """Every ``torch.ops.spore.*`` overload in one graph (or all) with its count."""
        chosen = self.graphs if graph is None else [self.graphs[graph]]
        total: collections.Counter[str] = collections.Counter()
        for counts in chosen:
            total.update({k: v for k, v in counts.items() if k.startswith("spore.")})
        return dict(total)


def _op_counts(gm: torch.fx.GraphModule) -> collections.Counter[str]:
    return collections.Counter(
        str(node.target) for node in gm.graph.nodes if node.op == "call_function"
    )


@pytest.fixture
def mfusion_compile(spore_manager: Any) -> Callable[..., Compiled]:
    """``mfusion_compile(fn, *args, env=None)``: ``torch.compile(fn, backend="spore")`` in a
    fresh plugin manager, called on ``args``; records every post-grad graph after the passes
    (forward first, then backward when the caller runs one)."""

    def run(fn: Callable[..., Any], *args: Any, env: dict[str, str] | None = None) -> Compiled:
        manager = spore_manager(env)
        result = Compiled(outputs=None)

        def record(gm: torch.fx.GraphModule) -> int:
            result.graphs.append(_op_counts(gm))
            return 0

        manager.registry("passes").add(
            record, name="test.recorder", stage="post_grad", priority=RECORDER_PRIORITY
        )
        torch._dynamo.reset()
        result.outputs = torch.compile(fn, backend="spore")(*args)
        return result

    return run


@pytest.fixture
def only_autofuse() -> Iterator[None]:
    """mfusion's hand-written passes off, so the graphs show automatic fusion alone."""
    import mfusion
    from mfusion.selection import reset

    mfusion.disable_passes(*(n for n in mfusion.pass_names() if n != "autofuse"))
    yield
    reset()
