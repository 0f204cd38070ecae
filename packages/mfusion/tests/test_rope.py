"""The RoPE pass on real Hugging Face attention code, compiled with mfusion vs eager.

Llama's attention (rotate-half, tables from ``LlamaRotaryEmbedding``, x ``[B, H, S, D]``) and
GPT-J's (interleaved, tables from ``GPTJRotaryEmbedding`` repeated per pair, partial rotary:
x is the first ``rotary_dim`` columns of ``[B, S, H, D]``) each rotate q and k: two
``spore.rope`` per forward graph. Forward+backward runs on the two models'
``apply_rotary_pos_emb`` (the attention's own backward would only add compile time): the
forward graph matches too, as RoPE saves nothing of its own for backward (the tables are
inputs); the backward graph holds the transposed rotation (``grad * cos - rot(grad * sin)``),
which is not this pattern.

Tolerance (largest absolute difference over the largest absolute eager value): float32 1e-5;
bfloat16 2e-2 (spore.rope and Inductor's fused code round once from float32, eager bfloat16
rounds each product and the sum, and so on through the attention).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GPTJConfig, LlamaConfig
from transformers.models.gptj.modeling_gptj import GPTJAttention, GPTJRotaryEmbedding
from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj_rope
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaRotaryEmbedding,
    rotate_half,
)
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rope

from mfusion.passes.rope import PASSES

BATCH, SEQ, HIDDEN, HEADS = 2, 6, 32, 4
ROPE = "spore.rope.default"
ROTARY = 4  # GPT-J rotates the first ROTARY columns of each head (head dim 8)
ATTENTION = "sdpa"  # what a model's config picks on CPU; a layer alone must be told


def _randn(dtype: torch.dtype, *shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


class Attention(torch.nn.Module):
    """An HF attention layer fed with its model's rotary tables; returns the attention output."""

    def __init__(self, attention: torch.nn.Module, rotary: torch.nn.Module) -> None:
        super().__init__()
        self.attention, self.rotary = attention, rotary

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
        tables = self.rotary(hidden, positions)
        return self.attention(hidden, position_embeddings=tables)[0]


def _llama() -> torch.nn.Module:
    config = LlamaConfig(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=2, head_dim=8
    )
    config._attn_implementation = ATTENTION
    return Attention(LlamaAttention(config, layer_idx=0), LlamaRotaryEmbedding(config))


def _gptj() -> torch.nn.Module:
    config = GPTJConfig(n_embd=HIDDEN, n_head=HEADS, rotary_dim=ROTARY, n_positions=16)
    config._attn_implementation = ATTENTION
    return Attention(GPTJAttention(config, layer_idx=0), GPTJRotaryEmbedding(config))


@pytest.mark.parametrize(
    ("build", "dtype"),
    [
        pytest.param(_llama, torch.float32, id="llama-half-fp32"),
        pytest.param(_gptj, torch.bfloat16, id="gptj-interleaved-bf16"),
    ],
)
def test_attention_rotates_q_and_k_with_two_spore_ropes(
    mfusion_compile, assert_rel_close, build, dtype
) -> None:
    module = build().to(dtype).eval()
    hidden = _randn(dtype, BATCH, SEQ, HIDDEN)
    with torch.no_grad():
        compiled = mfusion_compile(module, hidden)
        assert_rel_close(compiled.outputs, copy.deepcopy(module)(hidden), "output")
    assert len(compiled.graphs) == 1
    assert compiled.count(ROPE) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_training_forward_matches_and_grads_equal_eager(
    mfusion_compile, assert_rel_close, dtype
) -> None:
    """Llama's q/k and GPT-J's rotation: 3 ropes in the forward graph, none in the backward."""
    inputs = _both_modes_inputs(dtype, SEQ)
    leaves = {n: t.requires_grad_() for n, t in inputs.items() if n in ("q", "k", "x")}
    compiled = mfusion_compile(_both_modes, *inputs.values())
    eager_leaves = {n: t.detach().clone().requires_grad_() for n, t in leaves.items()}
    wanted = _both_modes(**{**inputs, **eager_leaves})
    upstreams = [_randn(dtype, *w.shape, seed=7 + i) for i, w in enumerate(wanted)]
    torch.autograd.backward(compiled.outputs, upstreams)
    torch.autograd.backward(wanted, upstreams)
    for got, want in zip(compiled.outputs, wanted, strict=True):
        assert_rel_close(got, want, "output")
    for name, leaf in leaves.items():
        assert_rel_close(leaf.grad, eager_leaves[name].grad, f"grad of {name}")
    assert len(compiled.graphs) == 2
    assert compiled.count(ROPE, graph=0) == 3
    assert compiled.count(ROPE, graph=1) == 0


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's rotate-half RoPE as ``apply_rotary_pos_emb`` writes it."""
    return x * cos + rotate_half(x) * sin


@pytest.mark.parametrize(("dtype", "ropes"), [(torch.bfloat16, 0), (torch.float32, 1)])
def test_16_bit_rope_left_alone_when_inductor_emulates_casts(dtype, ropes) -> None:
    """With ``emulate_precision_casts`` Inductor rounds each bf16 product and the sum as eager
    does, where spore.rope rounds once: the bf16 form stays Inductor's."""
    from torch._inductor import config
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes.post_grad import view_to_reshape
    from torch.fx.experimental.proxy_tensor import make_fx

    x, cos, sin = (
        _randn(dtype, 2, 4, 16, 32),
        _randn(dtype, 1, 1, 16, 32),
        _randn(dtype, 1, 1, 16, 32),
    )
    with config.patch(emulate_precision_casts=True):
        gm = make_fx(_rope, select_decomp_table(), tracing_mode="fake")(x, cos, sin)
        view_to_reshape(gm)
        for pass_ in PASSES:
            pass_(gm)
    assert sum(str(n.target) == ROPE for n in gm.graph.nodes) == ropes


def _negative_cases() -> dict[str, tuple[torch.Tensor, ...]]:
    """Rotate-half computations spore.rope must not take, as (x, cos, sin)."""
    f32, bf16 = torch.float32, torch.bfloat16
    return {
        "odd last dim": (_randn(f32, 2, 3, 7), _randn(f32, 3, 7), _randn(f32, 3, 7)),
        "tables promote bf16 x to fp32": (
            _randn(bf16, 2, 3, 8),
            _randn(f32, 3, 8),
            _randn(f32, 3, 8),
        ),
        "int64": tuple(torch.arange(48).reshape(2, 3, 8) - k for k in range(3)),
        "x broadcasts up to the tables": (
            _randn(f32, 1, 3, 8),
            _randn(f32, 4, 3, 8),
            _randn(f32, 4, 3, 8),
        ),
        "cos and sin of two shapes": (
            _randn(f32, 2, 3, 8),
            _randn(f32, 1, 3, 8),
            _randn(f32, 3, 8),
        ),
    }


def test_what_the_op_cannot_take_is_left_alone(mfusion_compile) -> None:
    cases = _negative_cases()

    def every_case(*flat: torch.Tensor) -> list[torch.Tensor]:
        return [_rope(*flat[i : i + 3]) for i in range(0, len(flat), 3)]

    flat = [t for case in cases.values() for t in case]
    with torch.no_grad():
        compiled = mfusion_compile(every_case, *flat)
    assert compiled.count(ROPE) == 0
    assert compiled.count("aten.cat.default") == len(cases)
    for name, got, want in zip(cases, compiled.outputs, every_case(*flat), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=name)


def _tables(dtype: torch.dtype, seq: int) -> dict[str, torch.Tensor]:
    """Llama's (cos, sin) ``[1, S, 8]``, GPT-J's (sin, cos) ``[1, S, ROTARY / 2]``."""
    positions = torch.arange(seq)[None]
    hidden = torch.empty(1, seq, HIDDEN, dtype=dtype)
    cos, sin = _llama().rotary(hidden, positions)
    sin_j, cos_j = _gptj().rotary(hidden, positions)
    return {"cos": cos, "sin": sin, "sin_j": sin_j, "cos_j": cos_j}


def _both_modes(
    q: torch.Tensor,
    k: torch.Tensor,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    sin_j: torch.Tensor,
    cos_j: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """Llama's q/k rotation ``[B, H, S, D]`` and GPT-J's ``[B, S, H, D]`` (3 ropes)."""
    return (*llama_rope(q, k, cos, sin), gptj_rope(x, sin_j, cos_j))


def _both_modes_inputs(dtype: torch.dtype, seq: int) -> dict[str, torch.Tensor]:
    return {
        "q": _randn(dtype, BATCH, HEADS, seq, 8),
        "k": _randn(dtype, BATCH, 2, seq, 8, seed=1),
        "x": _randn(dtype, BATCH, seq, HEADS, ROTARY, seed=2),
        **_tables(dtype, seq),
    }


def test_pass_is_idempotent_on_a_real_graph(mfusion_compile) -> None:
    """A second run on the compiled post-grad graph finds nothing and changes nothing."""
    with torch.no_grad():
        inputs = _both_modes_inputs(torch.float32, SEQ)
        compiled = mfusion_compile(_both_modes, *inputs.values(), rerun=PASSES)
    assert compiled.reruns == [([0], {ROPE: 3}, True)]


def test_dynamic_sequence_length_still_matches(mfusion_compile, assert_rel_close) -> None:
    """One compile with the sequence dimension symbolic serves two lengths."""
    first = _both_modes_inputs(torch.float32, SEQ)
    second = _both_modes_inputs(torch.float32, SEQ + 3)
    for inputs in (first, second):
        for name, dim in {
            "q": 2,
            "k": 2,
            "x": 1,
            "cos": 1,
            "sin": 1,
            "sin_j": 1,
            "cos_j": 1,
        }.items():
            torch._dynamo.mark_dynamic(inputs[name], dim)
    with torch.no_grad():
        compiled = mfusion_compile(_both_modes, *first.values())
        again = torch.compile(_both_modes, backend="spore")(*second.values())
    assert len(compiled.graphs) == 1
    assert compiled.count(ROPE) == 3
    for got, want in zip(
        (*compiled.outputs, *again), (*_both_modes(**first), *_both_modes(**second)), strict=True
    ):
        assert_rel_close(got, want, "output")


def test_mfusion_disable_rope_leaves_rope(mfusion_compile, monkeypatch) -> None:
    monkeypatch.setenv("MFUSION_DISABLE", "rope")
    inputs = _both_modes_inputs(torch.float32, SEQ)
    with torch.no_grad():
        compiled = mfusion_compile(_both_modes, *inputs.values())
    assert compiled.count(ROPE) == 0
    assert compiled.count("aten.cat.default") == 3
    for got, want in zip(compiled.outputs, _both_modes(**inputs), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    """GPT-J's ``rotate_every_two``."""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def _rotate_half_chunks(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


SPELLINGS = {
    "halves by chunk": lambda x, c, s: x * c + _rotate_half_chunks(x) * s,
    "terms swapped": lambda x, c, s: rotate_half(x) * s + x * c,
    "factors swapped": lambda x, c, s: c * x + s * rotate_half(x),
    "cos first": lambda x, c, s: c * x + rotate_half(x) * s,
    "all swapped": lambda x, c, s: s * rotate_half(x) + c * x,
    "gptj terms swapped": lambda x, c, s: _rotate_every_two(x) * s + x * c,
    "gptj factors swapped": lambda x, c, s: c * x + s * _rotate_every_two(x),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", SPELLINGS)
def test_operand_orders_match_with_eager_values_and_grads(
    mfusion_compile, assert_rel_close, name, dtype
) -> None:
    """Either operand order of each product and of the sum is one RoPE (forward+backward)."""
    form = SPELLINGS[name]
    x = _randn(dtype, BATCH, HEADS, SEQ, 8).requires_grad_()
    cos, sin = _randn(dtype, 1, 1, SEQ, 8, seed=1), _randn(dtype, 1, 1, SEQ, 8, seed=2)
    compiled = mfusion_compile(form, x, cos, sin)
    eager_x = x.detach().clone().requires_grad_()
    want = form(eager_x, cos, sin)
    upstream = _randn(dtype, *want.shape, seed=3)
    compiled.outputs.backward(upstream)
    want.backward(upstream)
    assert_rel_close(compiled.outputs, want, "output")
    assert_rel_close(x.grad, eager_x.grad, "grad of x")
    assert compiled.count(ROPE, graph=0) == 1


NOT_ROPE = {
    "rotated term subtracted": lambda x, c, s: x * c - rotate_half(x) * s,
    "rotated term minus the plain one": lambda x, c, s: rotate_half(x) * s - x * c,
    "a table added, not multiplied": lambda x, c, s: (x + c) + rotate_half(x) * s,
}


@pytest.mark.parametrize("name", NOT_ROPE)
def test_non_commutative_neighbours_left_alone(mfusion_compile, name) -> None:
    form = NOT_ROPE[name]
    x = _randn(torch.float32, BATCH, HEADS, SEQ, 8)
    cos, sin = (
        _randn(torch.float32, 1, 1, SEQ, 8, seed=1),
        _randn(torch.float32, 1, 1, SEQ, 8, seed=2),
    )
    with torch.no_grad():
        compiled = mfusion_compile(form, x, cos, sin)
    assert compiled.count(ROPE) == 0
    torch.testing.assert_close(compiled.outputs, form(x, cos, sin), rtol=0, atol=0)
