"""The RoPE pass on real Hugging Face attention layers, compiled with mfusion vs eager.

Llama's attention (rotate-half, tables from ``LlamaRotaryEmbedding``, x ``[B, H, S, D]``) and
GPT-J's (interleaved, tables from ``GPTJRotaryEmbedding`` repeated per pair, partial rotary:
x is the first ``rotary_dim`` columns of ``[B, S, H, D]``). Each rotates q and k: two
``spore.rope`` per forward graph. In a forward+backward compile the forward graph matches too
(RoPE saves only its output for the attention's backward); the backward graph holds the
transposed rotation (``grad * cos - rot(grad * sin)``), which is not this pattern.

Tolerance (largest absolute difference over the largest absolute eager value): float32 1e-5;
bfloat16 2e-2 (spore.rope and Inductor's fused code round once from float32, eager bfloat16
rounds each product and the sum, and so on through the attention).
"""

from __future__ import annotations

import copy

import pytest
import torch
from mfusion.passes.rope import PASSES
from transformers import GPTJConfig, LlamaConfig
from transformers.models.gptj.modeling_gptj import GPTJAttention, GPTJRotaryEmbedding
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaRotaryEmbedding,
    rotate_half,
)

BATCH, SEQ, HIDDEN, HEADS = 2, 6, 32, 4
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
ROPE = "spore.rope.default"
ATTENTION = "sdpa"  # what a model's config picks on CPU; a layer alone must be told


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, what
    assert got.shape == want.shape, what
    tol = TOLERANCE[want.dtype] * want.abs().max().item()
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol:.3g}"


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
    config = GPTJConfig(n_embd=HIDDEN, n_head=HEADS, rotary_dim=4, n_positions=16)
    config._attn_implementation = ATTENTION
    return Attention(GPTJAttention(config, layer_idx=0), GPTJRotaryEmbedding(config))


@pytest.mark.parametrize(
    ("build", "dtype", "train"),
    [
        pytest.param(_llama, torch.float32, True, id="llama-half-fp32-train"),
        pytest.param(_llama, torch.bfloat16, False, id="llama-half-bf16-forward"),
        pytest.param(_gptj, torch.float32, False, id="gptj-interleaved-fp32-forward"),
        pytest.param(_gptj, torch.bfloat16, True, id="gptj-interleaved-bf16-train"),
    ],
)
def test_attention_rotates_q_and_k_with_two_spore_ropes(
    mfusion_compile, build, dtype, train
) -> None:
    module = build().to(dtype).eval()
    eager = copy.deepcopy(module)
    hidden = _randn(dtype, BATCH, SEQ, HIDDEN)
    if not train:
        with torch.no_grad():
            compiled = mfusion_compile(module, hidden)
            _close(compiled.outputs, eager(hidden), "output")
        assert compiled.count(ROPE) == 2
        return
    h_c, h_e = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    compiled = mfusion_compile(module, h_c)
    want = eager(h_e)
    _close(compiled.outputs, want, "output")
    upstream = _randn(dtype, *want.shape, seed=1)
    compiled.outputs.backward(upstream)
    want.backward(upstream)
    _close(h_c.grad, h_e.grad, "grad of hidden")
    for (name, p_c), p_e in zip(module.named_parameters(), eager.parameters(), strict=True):
        _close(p_c.grad, p_e.grad, f"grad of {name}")
    assert len(compiled.graphs) == 2
    assert compiled.count(ROPE, graph=0) == 2
    assert compiled.count(ROPE, graph=1) == 0


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's rotate-half RoPE as ``apply_rotary_pos_emb`` writes it."""
    return x * cos + rotate_half(x) * sin


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


def test_pass_is_idempotent_on_a_real_graph(spore_manager) -> None:
    """A second run on the compiled post-grad graph finds nothing and changes nothing."""
    reruns = []

    def rerun(gm: torch.fx.GraphModule) -> int:
        before = [str(n.target) for n in gm.graph.nodes]
        counts = [pass_(gm) for pass_ in PASSES]
        after = [str(n.target) for n in gm.graph.nodes]
        reruns.append((counts, after.count(ROPE), after == before))
        return 0

    spore_manager().registry("passes").add(rerun, name="test.rerun", stage="post_grad", priority=1)
    module = _llama().eval()
    with torch.no_grad():
        torch.compile(module, backend="spore")(_randn(torch.float32, BATCH, SEQ, HIDDEN))
    assert reruns == [([0], 2, True)]


def test_mfusion_disable_rope_leaves_rope(mfusion_compile, monkeypatch) -> None:
    monkeypatch.setenv("MFUSION_DISABLE", "rope")
    module = _llama().eval()
    hidden = _randn(torch.float32, BATCH, SEQ, HIDDEN)
    with torch.no_grad():
        compiled = mfusion_compile(module, hidden)
        _close(compiled.outputs, copy.deepcopy(module)(hidden), "output")
    assert compiled.count(ROPE) == 0
    assert compiled.count("aten.cat.default") == 2
