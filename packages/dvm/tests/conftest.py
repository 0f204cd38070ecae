"""Shared test settings: the ``slow`` marker, a private Inductor cache for every test, the
graphs the ``dvm`` backend compiles, and the tiny Hugging Face Llama the model tests build."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: long cases; deselected unless a -m expression is given (-m slow)"
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
    """Every test compiles into an Inductor cache folder of its own, from a reset dynamo."""
    folder = str(tmp_path_factory.mktemp("inductor-cache"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", folder)
    torch._dynamo.reset()
    yield folder
    torch._dynamo.reset()


def _built(build, members, analysis) -> object:
    """What ``build(members, analysis)`` gives: the region's fields but its build time, or the
    error it raises (type and message)."""
    import dataclasses

    try:
        region = build(members, analysis)
    except Exception as e:  # the two builds' errors are compared
        return type(e), str(e)
    return [
        repr(getattr(region, f.name)) for f in dataclasses.fields(region) if f.name != "build_us"
    ]


def built_both(members, analysis):
    """``build_region(members, analysis)``, checked to equal the same build with every node
    lowered by its Python rule (none by ``csrc/emitter.c``'s forms, ``dvm.lower.NATIVE``)."""
    from dvm import _emitter, lower

    got = _built(_emitter.build_region, members, analysis)
    _emitter.setup_native({}, lower.NATIVE_DTYPES)
    try:
        want = _built(_emitter.build_region, members, analysis)
    finally:
        _emitter.setup_native(lower.NATIVE, lower.NATIVE_DTYPES)
    assert got == want, f"native {got}\n rules {want}"
    return _emitter.build_region(members, analysis)


@pytest.fixture
def native_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every region the test builds is checked to equal its build by the Python rules alone
    (see :func:`built_both`)."""
    from dvm import cluster

    monkeypatch.setattr(cluster, "build_region", built_both)


@pytest.fixture(autouse=True)
def native_oracle(request: pytest.FixtureRequest) -> None:
    """With ``DVM_NATIVE_ORACLE=1``, every test runs :func:`native_checked`."""
    if os.environ.get("DVM_NATIVE_ORACLE") == "1":
        request.getfixturevalue("native_checked")


@pytest.fixture
def backend_compiles(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every ``CompiledGraph`` the ``dvm`` backend (``torch.compile(..., backend="dvm")``)
    compiles during the test, in order."""
    import dvm.backend
    from dvm.compile import compile_graph

    graphs: list = []

    def recording(*args, **kwargs):
        graphs.append(compile_graph(*args, **kwargs))
        return graphs[-1]

    monkeypatch.setattr(dvm.backend, "compile_graph", recording)
    return graphs


@pytest.fixture
def tiny_llama() -> Callable[..., torch.nn.Module]:
    """Builds a tiny Hugging Face Llama (2 layers, 64 wide) from seed 0, with the given
    attention implementation (``"eager"`` or ``"sdpa"``)."""
    transformers = pytest.importorskip("transformers")

    def build(attention: str = "eager") -> torch.nn.Module:
        config = transformers.LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            attn_implementation=attention,
        )
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).eval()

    return build


@pytest.fixture
def registers_run_out() -> Callable[[torch.Tensor], torch.Tensor]:
    """A function of x with more values live at once than the VM has registers: its graph
    merges into one group that is split when built."""
    from dvm.program import MAX_REGS

    def fn(x: torch.Tensor) -> torch.Tensor:
        live = [(x + k).sin() for k in range(MAX_REGS + 4)]  # all live at once
        total = live[-1]
        for v in reversed(live[:-1]):
            total = total * v
        return total

    return fn


@pytest.fixture
def same_as_python_path() -> Callable[..., None]:
    """``check(compiled, gm, inputs, min_ops=...)``: ``compiled`` (``compile_graph`` of ``gm``)
    equals ``gm``'s compile by the Python path, the oracle of the common case in C
    (``dvm._analysis.compile``): the same regions, fallbacks, notes, runners, schedule and
    result objects, times aside."""
    import dvm.compile as dc

    def python_compiled(gm, inputs, min_ops):
        native, dc._COMPILE = dc._COMPILE, None
        try:
            return dc.compile_graph(gm, inputs, min_ops=min_ops)
        finally:
            dc._COMPILE = native

    calls = {"vm_calls", "eager_calls", "fallback_reasons"}

    def check(native, gm, inputs, *, min_ops: int) -> None:
        python = python_compiled(gm, inputs, min_ops)
        fields = ("nodes", "input_nodes", "input_views", "outputs", "output_slots", "domain")
        fields += ("program", "out_dtypes", "reduced")
        for a, b in zip(native.regions, python.regions, strict=True):
            assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]
        assert native.fallbacks == python.fallbacks
        assert native.clustering.notes == python.clustering.notes
        assert vars(native.clustering).keys() == vars(python.clustering).keys()
        for a, b in zip(native.runners, python.runners, strict=True):  # calls counted aside
            assert vars(a).keys() - calls == vars(b).keys() - calls
            assert (a.__name__, a._inputs, a._results) == (b.__name__, b._inputs, b._results)
        assert vars(native).keys() == vars(python).keys()
        assert (native.executor, native.eager_runs) == (python.executor, python.eager_runs)
        number = {id(r): k for k, r in enumerate(native.runners)}
        number.update({id(r): k for k, r in enumerate(python.runners)})
        assert [number.get(id(t), t) for t in native.run.targets] == [
            number.get(id(t), t) for t in python.run.targets
        ]

    return check
