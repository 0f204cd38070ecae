"""``spore bench dvm``: compile latency, runtime of fused chains, and a tiny Llama training step.

Three groups of cases, every side in this process under the allocator and thread settings
``spore bench`` applies to both:

- ``compile-<chain>``: dvm's compile (:func:`dvm.compile.compile_graph`) of a chain's aten
  graph inside ``torch.compile(fn, backend=dvm)``, right after dynamo and AOT autograd traced
  it (the mean of :data:`FLOW_COMPILES` compiles, tracing untimed), against Inductor's cold
  compile of that aten graph (``compile_fx`` in a fresh cache folder, FX graph cache off;
  the process's first Inductor compile, of another graph, is left out). Notes: the graph's
  dvm regions, the compile time per region (the graph's over its regions) and, dvm's side, a
  region's own compile (``region_compile_us``: lowering, program, encoding, launch binding).
- ``<chain>-<dtype>-<rows>x<cols>-vs-<baseline>``: ``torch.compile(fn, backend=dvm)`` against
  eager, ``torch.compile`` with Inductor, and ``copy``: a pre-allocated ``out.copy_(src)`` of
  as many bytes as the chain reads and writes (that ratio is the fraction of copy bandwidth).
  The shape is :data:`DEFAULT_SHAPE` unless ``DVM_BENCH_SHAPE`` gives another, e.g.
  ``DVM_BENCH_SHAPE=8192x4096 spore bench dvm`` for the issue's shape (minutes more).
- ``<chain>-<layout>-<dtype>-<rows>x<cols>-vs-<baseline>``: :data:`LAYOUT_CHAIN` on inputs
  stored otherwise than contiguously (:data:`LAYOUTS`), against eager and Inductor on the same
  tensors: the VM reads them through their strides.
- ``llama-train-<dtype>-vs-<baseline>``: a training step (forward, loss, backward, SGD) of a
  tiny Hugging Face Llama with ``backend=dvm`` against eager and Inductor. Notes: each side's
  compile time (its first step less a steady step; Inductor cold), the total time of
  :data:`AMORTISE_STEPS` steps including it, and ``crossover_steps``: the step count where
  the two sides' cumulative times meet (0 when they never do: one side leads throughout).

Before any timing the dvm side's output is checked against eager (the Llama case: its first
loss and gradients, from the same weights), and a chain case fails unless dvm ran the chain's
regions on the VM.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from spore.bench import Benchmark

SHAPE_ENV = "DVM_BENCH_SHAPE"
DEFAULT_SHAPE = (1024, 4096)
COMPILE_SHAPE = (64, 256)  # compile latency does not depend on the sizes
SAMPLE_S = 0.2  # each Llama sample runs at least this long
FLOW_COMPILES = 20  # torch.compile calls in a dvm compile sample (each traces for ~0.1 s)
AMORTISE_STEPS = 100
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2}
RUNTIME_BASELINES = {
    "eager": "eager PyTorch",
    "inductor": "torch.compile (Inductor)",
    "copy": "out.copy_(src) of the bytes the chain reads and writes",
}
TRAIN_BASELINES = {"eager": "eager PyTorch", "inductor": "torch.compile (Inductor, cold)"}
LAYOUTS = {  # a layout of the chain's inputs: what it is, which of them are stored transposed
    "transposed": ("x and y stored transposed", (0, 1)),
    "mixed": ("x stored transposed, y contiguous", (0,)),
}
LAYOUT_CHAIN = "silu_mul"
LAYOUT_BASELINES = ("eager", "inductor")
RECOMPILES = 64
DVM_LABEL = "torch.compile(backend='dvm')"
EPS = 1e-6


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3.0))))


def _silu_mul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x) * y


def _softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, dim=-1)


def _rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return w * h.to(x.dtype)


def _bias_gelu(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x + b)


@dataclass(frozen=True)
class Chain:
    """A fusible chain: ``fn`` over a ``[rows, cols]`` ``x`` and, per ``extra`` letter, a
    second ``[rows, cols]`` tensor (``m``) or a ``[cols]`` vector (``v``)."""

    name: str
    fn: Callable[..., torch.Tensor]
    extra: str
    what: str
    min_ops: int = 2  # dvm's side: 1 times a chain of one eager kernel on the VM all the same

    def inputs(
        self, shape: tuple[int, int], dtype: torch.dtype, seed: int = 0
    ) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        sizes = [shape] + [shape if kind == "m" else shape[-1:] for kind in self.extra]
        return tuple(torch.randn(s, generator=g).to(dtype) for s in sizes)


CHAINS = {
    c.name: c
    for c in (
        Chain("silu", _silu, "", "x*sigmoid(x)"),
        Chain("gelu_tanh", _gelu_tanh, "", "GELU, tanh approximation, written out"),
        Chain("silu_mul", _silu_mul, "m", "x*sigmoid(x)*y"),
        Chain(
            "softmax",
            _softmax,
            "",
            "torch.softmax over the last dim (on the VM: dvm's backend leaves it to PyTorch)",
            min_ops=1,
        ),
        Chain("rms_norm", _rms_norm, "v", "RMSNorm as in HF Llama (fp32 statistics)"),
        Chain("bias_gelu", _bias_gelu, "v", "gelu(x + bias), erf GELU"),
    )
}


def bench_shape() -> tuple[int, int]:
    """The runtime cases' shape: ``DVM_BENCH_SHAPE`` (``ROWSxCOLS``) or :data:`DEFAULT_SHAPE`."""
    raw = os.environ.get(SHAPE_ENV, "").strip()
    if not raw:
        return DEFAULT_SHAPE
    parts = raw.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(
            f"{SHAPE_ENV}={raw!r}: give two positive sizes as ROWSxCOLS, e.g. 8192x4096"
        )
    return int(parts[0]), int(parts[1])


def _dvm_backend() -> Callable[..., Any]:
    from dvm.backend import dvm_backend

    return dvm_backend


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _close(name: str, expected: torch.Tensor, actual: torch.Tensor) -> None:
    tol = TOLERANCE[expected.dtype]
    torch.testing.assert_close(
        actual.float(), expected.float(), rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}"
    )


# ---- compile latency -------------------------------------------------------------------


def _trace(fn: Callable[..., Any], inputs: list[torch.Tensor]) -> torch.fx.GraphModule:
    """``fn``'s aten graph with dvm's decompositions: the graph dvm's backend compiles."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from dvm.lower import decomposition_table

    return make_fx(fn, decomposition_table=decomposition_table())(*inputs)


@functools.lru_cache(maxsize=1)
def _warm() -> None:
    """One compile of another graph by each side: the process's first compile pays imports
    and Inductor's one-time set-up, which no graph's compile time should include."""
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.utils import fresh_cache

    from dvm.compile import compile_graph

    inputs = [torch.randn(4, 8)]
    gm = _trace(lambda x: (x + 1) * x, inputs)
    compile_graph(copy.deepcopy(gm), inputs)
    with fresh_cache(), torch._inductor.config.patch(fx_graph_cache=False):
        compile_fx(gm, inputs)


@functools.lru_cache(maxsize=1)
def _aten_graph(chain: str) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    _warm()
    inputs = list(CHAINS[chain].inputs(COMPILE_SHAPE, torch.float32))
    return _trace(CHAINS[chain].fn, inputs), inputs


def _dvm_regions(compiled: Any) -> int:
    return len(compiled.regions)


def flow_compiles(chain: str, count: int) -> list[Any]:
    """``count`` compiles of ``chain``'s graph by dvm where its backend runs them: inside
    ``torch.compile``, right after dynamo and AOT autograd traced the chain (so with caches as
    cold as a real compile leaves them); each :class:`dvm.compile.CompiledGraph`, checked
    against eager."""
    from dvm.backend import make_backend

    graphs: list[Any] = []
    backend = make_backend(
        lambda _kind, compiled: graphs.append(compiled), min_ops=CHAINS[chain].min_ops
    )
    compile_in_flow(chain, count, backend)
    if len(graphs) != count:
        raise RuntimeError(f"compile-{chain}: {len(graphs)} graphs compiled for {count} calls")
    return graphs


def compile_in_flow(chain: str, count: int, backend: Any) -> None:
    """``torch.compile`` ``chain`` with ``backend`` ``count`` times from a reset dynamo (after
    one-time set-up, :func:`_warm`), each result checked against eager."""
    _warm()
    spec = CHAINS[chain]
    inputs = spec.inputs(COMPILE_SHAPE, torch.float32)
    for _ in range(count):
        torch._dynamo.reset()
        with torch.no_grad():
            out = torch.compile(spec.fn, backend=backend, dynamic=False)(*inputs)
    _close(f"compile-{chain}", spec.fn(*inputs), out)


def _compile_dvm(chain: str) -> Callable[[Any], dict[str, float]]:
    def timed(_: Any) -> dict[str, float]:
        graphs = flow_compiles(chain, FLOW_COMPILES)
        seconds = 1e-6 * sum(g.total_us for g in graphs) / len(graphs)
        runners = [r for g in graphs for r in g.runners]
        own = sum(r.compile_us for r in runners) / max(len(runners), 1)
        return {**_compile_figures(seconds, len(graphs[-1].regions)), "region_compile_us": own}

    return timed


def _compile_figures(seconds: float, regions: int) -> dict[str, float]:
    """A compile sample: seconds, the graph's dvm regions and microseconds per region."""
    return {
        "seconds": seconds,
        "regions": regions,
        "us_per_region": 1e6 * seconds / max(regions, 1),
    }


def _first(result: Any) -> torch.Tensor:
    return result[0] if isinstance(result, (tuple, list)) else result


def _compile_inductor(chain: str) -> Callable[[Any], dict[str, float]]:
    def timed(_: Any) -> dict[str, float]:
        from torch._inductor.compile_fx import compile_fx
        from torch._inductor.utils import fresh_cache

        from dvm.compile import compile_graph

        gm, inputs = _aten_graph(chain)
        regions = _dvm_regions(
            compile_graph(copy.deepcopy(gm), inputs, min_ops=CHAINS[chain].min_ops)
        )
        graph = copy.deepcopy(gm)
        with fresh_cache(), torch._inductor.config.patch(fx_graph_cache=False):
            start = time.perf_counter()
            compiled = compile_fx(graph, inputs)
            seconds = time.perf_counter() - start
        _close(f"compile-{chain} (Inductor)", CHAINS[chain].fn(*inputs), _first(compiled(*inputs)))
        return _compile_figures(seconds, regions)

    return timed


def compile_cases() -> list[Benchmark]:
    """dvm's compile of each chain's aten graph against Inductor's cold compile of it."""
    rows, cols = COMPILE_SHAPE
    return [
        Benchmark(
            name=f"compile-{chain.name}",
            baseline=_compile_inductor(chain.name),
            candidate=_compile_dvm(chain.name),
            baseline_label=f"Inductor cold compile (fresh cache, FX graph cache off), {chain.what}",
            candidate_label="dvm.compile.compile_graph inside torch.compile",
            description=f"compile latency of the aten graph of {chain.what} at {rows}x{cols} "
            "fp32; notes: dvm regions in the graph, microseconds per region, and a region's own "
            "compile in microseconds (dvm)",
            self_timed=True,
        )
        for chain in CHAINS.values()
    ]


# ---- runtime of fused chains -----------------------------------------------------------


def _laid_out(args: tuple[torch.Tensor, ...], layout: str) -> tuple[torch.Tensor, ...]:
    """``args`` with the same values, those :data:`LAYOUTS` names stored transposed."""
    moved = LAYOUTS[layout][1] if layout in LAYOUTS else ()
    return tuple(a.t().contiguous().t() if k in moved else a for k, a in enumerate(args))


@functools.lru_cache(maxsize=1)
def _runtime_state(
    chain: str, dtype: str, shape: tuple[int, int], layout: str = "contiguous"
) -> dict[str, Any]:
    """The chain's inputs, its three compiled/eager sides (compiled and run once) and the copy
    buffers (the last key's state is kept: the cases of one chain and dtype share it)."""
    from dvm.backend import make_backend

    spec = CHAINS[chain]
    args = _laid_out(spec.inputs(shape, DTYPES[dtype]), layout)
    graphs: list[Any] = []
    backend = make_backend(lambda _kind, compiled: graphs.append(compiled), min_ops=spec.min_ops)
    sides = {
        "eager": spec.fn,
        "inductor": torch.compile(spec.fn, dynamic=False),
        "dvm": torch.compile(spec.fn, backend=backend, dynamic=False),
    }
    # each dtype and layout of a chain is another compile of its code on each side: more
    # than dynamo's default of 8 for the layout chain, past which it would run eagerly
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=RECOMPILES):
        outs = {side: fn(*args) for side, fn in sides.items()}
    if not any(g.regions for g in graphs) or any(g.eager_calls for g in graphs):
        left = [f"{n.target}: {why}" for g in graphs for n, why in g.fallbacks]
        raise RuntimeError(
            f"{chain}: dvm ran no region on the VM, or a region fell back to eager; the "
            f"figure would time eager aten (ops left to eager: {left})"
        )
    half = (_nbytes(*args) + _nbytes(outs["eager"])) // 2
    return {
        "args": args,
        **sides,
        "copy_src": torch.ones(half, dtype=torch.uint8),
        "copy_dst": torch.empty(half, dtype=torch.uint8),
    }


def _call(side: str) -> Callable[[dict[str, Any]], Any]:
    def call(state: dict[str, Any]) -> Any:
        with torch.no_grad():
            return state[side](*state["args"])

    return call


def _copy(state: dict[str, Any]) -> None:
    state["copy_dst"].copy_(state["copy_src"])


def _checker(name: str) -> Callable[[Any, Any], None]:
    def check(expected: torch.Tensor, actual: torch.Tensor) -> None:
        _close(name, expected, actual)

    return check


def _runtime_case(
    chain: Chain, tag: str, shape: tuple[int, int], baseline: str, layout: str = "contiguous"
) -> Benchmark:
    """``chain`` in ``tag`` at ``shape`` (inputs as ``layout`` stores them) against
    ``baseline``, one of :data:`RUNTIME_BASELINES`."""
    rows, cols = shape
    if layout == "contiguous":
        where, stored, detail = "", "", "inference"
    else:
        where, stored, detail = f"-{layout}", f", {LAYOUTS[layout][0]}", LAYOUTS[layout][0]
    name = f"{chain.name}{where}-{tag}-{rows}x{cols}-vs-{baseline}"
    return Benchmark(
        name=name,
        baseline=_copy if baseline == "copy" else _call(baseline),
        candidate=_call("dvm"),
        baseline_label=f"{RUNTIME_BASELINES[baseline]}, {chain.what}{stored}, {rows}x{cols} {tag}",
        candidate_label=DVM_LABEL,
        setup=functools.partial(_runtime_state, chain.name, tag, shape, layout),
        check=None if baseline == "copy" else _checker(name),
        description=f"{chain.what} on [{rows}, {cols}] {tag}, {detail}",
    )


def runtime_cases(shape: tuple[int, int] | None = None) -> list[Benchmark]:
    """Each chain x dtype against eager, Inductor and a copy of the same bytes; the layout
    chain on each of :data:`LAYOUTS` against eager and Inductor."""
    shape = shape or bench_shape()
    out = [
        _runtime_case(chain, tag, shape, baseline)
        for chain in CHAINS.values()
        for tag in DTYPES
        for baseline in RUNTIME_BASELINES
    ]
    out += [
        _runtime_case(CHAINS[LAYOUT_CHAIN], tag, shape, baseline, layout)
        for layout in LAYOUTS
        for tag in DTYPES
        for baseline in LAYOUT_BASELINES
    ]
    return out


# ---- tiny Llama training step ----------------------------------------------------------


@dataclass(frozen=True)
class LlamaSize:
    """The tiny Llama's dimensions and batch."""

    batch: int
    seq: int
    vocab: int
    hidden: int
    heads: int
    ffn: int
    layers: int


LLAMA = LlamaSize(batch=2, seq=128, vocab=1024, hidden=256, heads=4, ffn=688, layers=2)


def _llama(size: LlamaSize) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=size.vocab,
        hidden_size=size.hidden,
        intermediate_size=size.ffn,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.heads // 2,
        max_position_embeddings=2 * size.seq,
    )
    return transformers.LlamaForCausalLM(config)


def aot_backend(
    compiler: Callable[[torch.fx.GraphModule, Sequence[Any]], Callable[..., Any]],
) -> Any:
    """AOT autograd with dvm's decompositions and ``compiler`` for both graphs, each as it is
    traced (no specialising of symbolic sizes): the tools' sides between eager and dvm."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from dvm.lower import decomposition_table

    def boxed(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        return make_boxed_func(compiler(gm, example_inputs))

    return aot_autograd(fw_compiler=boxed, bw_compiler=boxed, decompositions=decomposition_table())


def seeded_llama(dtype: torch.dtype) -> tuple[torch.nn.Module, torch.Tensor]:
    """The tiny Llama (:data:`LLAMA`) from seed 0 in ``dtype``, in training mode, and its batch
    of token ids (seed 1): every side of a Llama figure starts from these."""
    torch.manual_seed(0)
    model = _llama(LLAMA).to(dtype).train()
    g = torch.Generator().manual_seed(1)
    return model, torch.randint(0, LLAMA.vocab, (LLAMA.batch, LLAMA.seq), generator=g)


def llama_step(dtype: torch.dtype, options: dict[str, Any] | None = None) -> Callable[[int], None]:
    """A training step (forward, loss, backward, SGD) of :func:`seeded_llama`'s model on the
    first ``length`` tokens of its batch, under ``torch.compile(model, **options)`` (eager
    when ``None``): the tools' Llama sides."""
    model, ids = seeded_llama(dtype)
    forward = model if options is None else torch.compile(model, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(length: int) -> None:
        batch = ids[:, :length]
        optimizer.zero_grad(set_to_none=True)
        forward(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()

    return step


@dataclass
class _Trainer:
    """One side: a model, its (compiled) forward, an optimizer, a batch and measured times."""

    model: torch.nn.Module
    forward: Callable[..., Any]
    optimizer: torch.optim.Optimizer
    batch: dict[str, torch.Tensor]
    compile_s: float = 0.0
    step_s: float = 0.0  # the latest steady step time
    loops: int = 1
    first: tuple[torch.Tensor, list[torch.Tensor]] | None = None  # first loss, gradients

    def step(self) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.forward(**self.batch).loss
        loss.backward()
        self.optimizer.step()
        return loss

    def first_step(self) -> None:
        """The first step, keeping its loss and gradients (before the update)."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.forward(**self.batch).loss
        loss.backward()
        self.first = (loss.detach(), [p.grad.detach().clone() for p in self.model.parameters()])
        self.optimizer.step()

    def steady(self, loops: int) -> float:
        """Seconds per step over ``loops`` steps (kept as :attr:`step_s`)."""
        start = time.perf_counter()
        for _ in range(loops):
            self.step()
        self.step_s = (time.perf_counter() - start) / loops
        return self.step_s


def _check_first_step(dtype: str, eager: _Trainer, dvm: _Trainer) -> None:
    if eager.first is None or dvm.first is None:
        raise RuntimeError("the first step of each side runs before the check")
    (loss_e, grads_e), (loss_d, grads_d) = eager.first, dvm.first
    _close(f"llama-train-{dtype} loss", loss_e, loss_d)
    scale = max(float(g.abs().max()) for g in grads_e)  # gradients relative to the largest
    names = [n for n, _ in eager.model.named_parameters()]
    for name, ge, gd in zip(names, grads_e, grads_d, strict=True):
        _close(f"llama-train-{dtype} gradient of {name}", ge / scale, gd / scale)


@functools.cache
def _trainer(dtype: str, side: str) -> _Trainer:
    """One side from the tiny Llama's seeded weights, compiled by its first step (timed; for
    Inductor cold), dvm's first loss and gradients checked against eager's, then warmed up."""
    from torch._inductor.utils import fresh_cache

    model, ids = seeded_llama(DTYPES[dtype])
    backend = {"eager": None, "inductor": "inductor", "dvm": _dvm_backend()}[side]
    forward = model if backend is None else torch.compile(model, backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    trainer = _Trainer(model, forward, optimizer, {"input_ids": ids, "labels": ids})
    with fresh_cache(), torch._inductor.config.patch(fx_graph_cache=False):
        start = time.perf_counter()
        trainer.first_step()
        first_s = time.perf_counter() - start
    if side == "dvm":
        _check_first_step(dtype, _trainer(dtype, "eager"), trainer)
    step_s = trainer.steady(2)
    trainer.compile_s = max(0.0, first_s - step_s)
    trainer.loops = max(1, math.ceil(SAMPLE_S / max(step_s, 1e-9)))
    return trainer


def crossover(cand: tuple[float, float], base: tuple[float, float]) -> float:
    """The step count where cumulative times ``compile + n * step`` of the candidate and the
    baseline (each ``(compile, step)``) meet; 0 when they never do (for n > 0)."""
    (c_compile, c_step), (b_compile, b_step) = cand, base
    if c_step == b_step:
        return 0.0
    n = (c_compile - b_compile) / (b_step - c_step)
    return max(n, 0.0)


def _train_side(dtype: str, side: str, baseline: str) -> Callable[[Any], dict[str, float]]:
    def timed(_: Any) -> dict[str, float]:
        own = _trainer(dtype, side)
        other = _trainer(dtype, "dvm" if side == baseline else baseline)
        seconds = own.steady(own.loops)
        pair = ((own.compile_s, seconds), (other.compile_s, other.step_s))
        cand, base = pair if side == "dvm" else pair[::-1]
        return {
            "seconds": seconds,
            "compile_s": own.compile_s,
            f"total_s_{AMORTISE_STEPS}_steps": own.compile_s + AMORTISE_STEPS * seconds,
            "crossover_steps": crossover(cand, base),
        }

    return timed


def train_cases() -> list[Benchmark]:
    """The tiny Llama's training step with dvm against eager and Inductor, per dtype."""
    s = LLAMA
    what = (
        f"tiny Llama train step (fwd, loss, bwd, SGD): batch {s.batch}, seq {s.seq}, hidden "
        f"{s.hidden}, {s.layers} layers"
    )
    return [
        Benchmark(
            name=f"llama-train-{tag}-vs-{baseline}",
            baseline=_train_side(tag, baseline, baseline),
            candidate=_train_side(tag, "dvm", baseline),
            baseline_label=f"{label}, {what} {tag}",
            candidate_label=DVM_LABEL,
            description=f"{what} {tag}; notes: compile seconds, total seconds of "
            f"{AMORTISE_STEPS} steps with the compile, steps where cumulative times meet",
            self_timed=True,
        )
        for tag in DTYPES
        for baseline, label in TRAIN_BASELINES.items()
    ]


def benchmarks() -> list[Benchmark]:
    """Every case: compile latency, runtime of the chains, the Llama training step."""
    return [*compile_cases(), *runtime_cases(), *train_cases()]
