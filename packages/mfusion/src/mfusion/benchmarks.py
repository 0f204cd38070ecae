"""``spore bench mfusion``: Hugging Face models with mfusion against plain Inductor and eager.

Each case is one model, phase (forward, or forward+backward) and dtype, against one baseline.
Models are built from configs with random weights (no download), at :data:`BENCH_SIZE`. The
three sides (mfusion, ``torch.compile`` with Inductor, eager) each own a copy of the same
weights; the two cases of a model/phase/dtype share them, compiled once. Before any timing the
mfusion side's output is checked against eager. Alongside the times each case reports the
post-grad nodes Inductor receives before and after mfusion's passes (forward and backward
graphs together) and the rewrites per pass (0 on the baseline side).

The mfusion side compiles with the passes mfusion registered (the same ones
``backend="spore"`` runs, without other plugins' passes), the FX graph cache off so they run.
"""

from __future__ import annotations

import copy
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from spore.bench import Benchmark

SAMPLE_S = 0.5  # each timed sample runs whole steps for at least this long
OWNER = "mfusion"
RECORDER_PRIORITY = 10**9  # before and after every other pass
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2}  # of the eager output's largest value


@dataclass(frozen=True)
class Size:
    """The dimensions every model is built with."""

    batch: int
    seq: int
    vocab: int
    hidden: int
    heads: int
    ffn: int
    layers: int
    image: int
    patch: int


BENCH_SIZE = Size(
    batch=2, seq=256, vocab=2048, hidden=512, heads=8, ffn=1408, layers=2, image=224, patch=16
)


def _llama_style(model: str, config: str, **extra: Any) -> Callable[[Size], torch.nn.Module]:
    def build(size: Size) -> torch.nn.Module:
        import transformers

        cfg = getattr(transformers, config)(
            vocab_size=size.vocab,
            hidden_size=size.hidden,
            intermediate_size=size.ffn,
            num_hidden_layers=size.layers,
            num_attention_heads=size.heads,
            num_key_value_heads=size.heads // 2,
            max_position_embeddings=2 * size.seq,
            **extra,
        )
        return getattr(transformers, model)(cfg)

    return build


def _head_dim(size: Size) -> dict[str, int]:
    return {"head_dim": size.hidden // size.heads}


def _gpt2(size: Size) -> torch.nn.Module:
    import transformers

    config = transformers.GPT2Config(
        vocab_size=size.vocab,
        n_positions=2 * size.seq,
        n_embd=size.hidden,
        n_layer=size.layers,
        n_head=size.heads,
        n_inner=size.ffn,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def _bert_style(size: Size, **extra: Any) -> dict[str, Any]:
    return {
        "hidden_size": size.hidden,
        "num_hidden_layers": size.layers,
        "num_attention_heads": size.heads,
        "intermediate_size": size.ffn,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        **extra,
    }


def _bert(size: Size) -> torch.nn.Module:
    import transformers

    config = transformers.BertConfig(
        **_bert_style(size, vocab_size=size.vocab, max_position_embeddings=2 * size.seq)
    )
    return transformers.BertModel(config, add_pooling_layer=False)


def _vit(size: Size) -> torch.nn.Module:
    import transformers

    config = transformers.ViTConfig(
        **_bert_style(size, image_size=size.image, patch_size=size.patch)
    )
    return transformers.ViTModel(config, add_pooling_layer=False)


def _t5(size: Size) -> torch.nn.Module:
    import transformers

    config = transformers.T5Config(
        vocab_size=size.vocab,
        d_model=size.hidden,
        d_kv=size.hidden // size.heads,
        d_ff=size.ffn,
        num_layers=size.layers,
        num_heads=size.heads,
        relative_attention_num_buckets=8,
        dropout_rate=0.0,
        decoder_start_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(config)


def _ids(size: Size, g: torch.Generator, length: int) -> torch.Tensor:
    return torch.randint(0, size.vocab, (size.batch, length), generator=g)


def _text(size: Size, g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"input_ids": _ids(size, g, size.seq)}


def _seq2seq(size: Size, g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"input_ids": _ids(size, g, size.seq), "decoder_input_ids": _ids(size, g, size.seq // 2)}


def _image(size: Size, g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(size.batch, 3, size.image, size.image, generator=g)}


@dataclass(frozen=True)
class ModelSpec:
    """How to build a model at a :class:`Size`, what to feed it and which output to read."""

    name: str
    build: Callable[[Size], torch.nn.Module]
    inputs: Callable[[Size, torch.Generator], dict[str, torch.Tensor]]
    output: str

    def forward(self, model: torch.nn.Module) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
        """``model``'s output tensor for a batch of inputs."""

        def run(batch: dict[str, torch.Tensor]) -> torch.Tensor:
            return getattr(model(**batch), self.output)

        return run


MODELS = {
    spec.name: spec
    for spec in (
        ModelSpec("llama", _llama_style("LlamaForCausalLM", "LlamaConfig"), _text, "logits"),
        ModelSpec("qwen2", _llama_style("Qwen2ForCausalLM", "Qwen2Config"), _text, "logits"),
        ModelSpec(
            "mistral",
            lambda s: _llama_style("MistralForCausalLM", "MistralConfig", **_head_dim(s))(s),
            _text,
            "logits",
        ),
        ModelSpec(
            "gemma",
            lambda s: _llama_style("GemmaForCausalLM", "GemmaConfig", **_head_dim(s))(s),
            _text,
            "logits",
        ),
        ModelSpec("gpt2", _gpt2, _text, "logits"),
        ModelSpec("bert", _bert, _text, "last_hidden_state"),
        ModelSpec("vit", _vit, _image, "last_hidden_state"),
        ModelSpec("t5", _t5, _seq2seq, "logits"),
    )
}
"""Every model the tests and benchmarks build, by short name."""

BENCH_MODELS = ("llama", "qwen2", "gemma", "gpt2", "bert", "vit")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PHASES = ("fwd", "fwdbwd")
BASELINES = {
    "inductor": "torch.compile (Inductor, no mfusion pass)",
    "eager": "eager PyTorch",
}


class _Counted:
    """A registered pass that adds its rewrites to ``tally`` (same name, version, behaviour)."""

    def __init__(self, pass_: Any, key: str, tally: dict[str, int]) -> None:
        self.pass_, self.key, self.tally = pass_, key, tally
        self.name = getattr(pass_, "name", key)

    @property
    def version(self) -> str:
        return str(getattr(self.pass_, "version", "1"))

    def __call__(self, gm: torch.fx.GraphModule) -> int:
        done = int(self.pass_(gm) or 0)
        self.tally[self.key] = self.tally.get(self.key, 0) + done
        return done


def _node_counter(key: str, tally: dict[str, int]) -> Callable[[torch.fx.GraphModule], int]:
    def count(gm: torch.fx.GraphModule) -> int:
        nodes = sum(node.op == "call_function" for node in gm.graph.nodes)
        tally[key] = tally.get(key, 0) + nodes
        return 0

    return count


def mfusion_registry(tally: dict[str, int]) -> Any:
    """A pass registry with mfusion's registered passes, each adding its rewrites to ``tally``
    (by short name), between two recorders of the post-grad node count (``nodes_before``,
    ``nodes_after``)."""
    from mfusion.selection import PREFIX, short_name
    from spore.plugins import get_manager
    from spore.registry import PassRegistry

    entries = [e for e in get_manager().registry("passes").entries() if e.name.startswith(PREFIX)]
    if not entries:
        raise RuntimeError(
            "no mfusion pass is registered: is the mfusion plugin disabled "
            "(SPORE_PLUGINS / SPORE_DISABLE_PLUGINS)? `spore plugins` shows its status"
        )
    registry = PassRegistry("passes")
    for entry in entries:
        with registry.owned_by(entry.owner, entry.owner_version):
            p = entry.value
            registry.add(
                _Counted(p.pass_, short_name(p.name), tally),
                name=p.name,
                stage=p.stage,
                priority=p.priority,
                device=p.device,
            )
    for key, priority in (("nodes_before", RECORDER_PRIORITY), ("nodes_after", -RECORDER_PRIORITY)):
        registry.add(_node_counter(key, tally), name=f"bench.{key}", priority=priority)
    return registry


def _mfusion_backend(registry: Any) -> Callable[..., Any]:
    from spore import graph_passes

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return graph_passes.compile_fx(gm, example_inputs, registry)

    return backend


def _step(
    forward: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    backward: bool,
    weights: torch.Tensor | None,
) -> Callable[[], torch.Tensor]:
    """One forward (no_grad), or forward and backward of a fixed projection of the output."""

    def run() -> torch.Tensor:
        if not backward:
            with torch.no_grad():
                return forward(batch)
        model.zero_grad(set_to_none=True)
        out = forward(batch)
        (out.float() * weights).sum().backward()
        return out

    return run


def _check(name: str, eager: torch.Tensor, fused: torch.Tensor) -> None:
    scale = eager.detach().float().abs().max().clamp_min(1e-6)
    error = (fused.detach().float() - eager.detach().float()).abs().max()
    limit = TOLERANCE[eager.dtype] * scale
    if not bool(error <= limit):
        raise AssertionError(
            f"{name}: mfusion's output differs from eager by {error:.3g} > {limit:.3g}"
        )


@dataclass
class _State:
    """The three sides of one model/phase/dtype, compiled and warmed up."""

    steps: dict[str, Callable[[], torch.Tensor]]
    loops: dict[str, int]
    tally: dict[str, int]


def _seconds(step: Callable[[], Any], loops: int) -> float:
    """Mean seconds per call over ``loops`` back-to-back calls of ``step``."""
    start = time.perf_counter()
    for _ in range(loops):
        step()
    return (time.perf_counter() - start) / loops


def _loops(step: Callable[[], Any]) -> int:
    """How many calls of ``step`` fill one sample of :data:`SAMPLE_S` (one call timed)."""
    return max(1, math.ceil(SAMPLE_S / max(_seconds(step, 1), 1e-9)))


@functools.lru_cache(maxsize=1)
def _state(model: str, phase: str, dtype: str) -> _State:
    """Build, compile and warm up the three sides (the last key's sides are kept for reuse)."""
    spec = MODELS[model]
    backward = phase == "fwdbwd"
    torch.manual_seed(0)
    base = spec.build(BENCH_SIZE).to(DTYPES[dtype]).train(backward)
    base.requires_grad_(backward)
    batch = spec.inputs(BENCH_SIZE, torch.Generator().manual_seed(1))
    tally: dict[str, int] = {}
    backends = {
        "eager": None,
        "inductor": "inductor",
        "mfusion": _mfusion_backend(mfusion_registry(tally)),
    }
    steps: dict[str, Callable[[], torch.Tensor]] = {}
    weights = None
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        for side, backend in backends.items():
            net = copy.deepcopy(base)
            forward = spec.forward(net)
            if backend is not None:
                forward = torch.compile(forward, backend=backend)
            if weights is None:
                with torch.no_grad():
                    shape = forward(batch).shape
                weights = torch.randn(shape, generator=torch.Generator().manual_seed(2))
            steps[side] = _step(forward, net, batch, backward, weights)
            steps[side]()  # compiles forward (and backward)
    _check(f"{model}-{phase}-{dtype}", steps["eager"](), steps["mfusion"]())
    return _State(steps, {side: _loops(step) for side, step in steps.items()}, tally)


def _side(model: str, phase: str, dtype: str, side: str) -> Callable[[Any], dict[str, float]]:
    def timed(_: Any) -> dict[str, float]:
        state = _state(model, phase, dtype)
        seconds = _seconds(state.steps[side], state.loops[side])
        fused = side == "mfusion"
        passes = {k: v for k, v in state.tally.items() if not k.startswith("nodes_") and v}
        return {
            "seconds": seconds,
            "nodes": state.tally["nodes_after" if fused else "nodes_before"],
            **{k: v if fused else 0 for k, v in sorted(passes.items())},
        }

    return timed


def _case(model: str, phase: str, dtype: str, baseline: str) -> Benchmark:
    s = BENCH_SIZE
    what = (
        f"{model} {phase} {dtype}: batch {s.batch}, seq {s.seq}, hidden {s.hidden}, "
        f"{s.layers} layers; extras: post-grad nodes and rewrites per pass"
    )
    return Benchmark(
        name=f"{model}-{phase}-{dtype}-vs-{baseline}",
        baseline=_side(model, phase, dtype, baseline),
        candidate=_side(model, phase, dtype, "mfusion"),
        baseline_label=f"{BASELINES[baseline]}, {model} {phase} {dtype}",
        candidate_label="torch.compile with mfusion's passes",
        description=what,
        self_timed=True,
    )


def benchmarks() -> list[Benchmark]:
    """Every model x phase x dtype, against Inductor and against eager."""
    return [
        _case(model, phase, dtype, baseline)
        for model in BENCH_MODELS
        for phase in PHASES
        for dtype in DTYPES
        for baseline in BASELINES
    ]
