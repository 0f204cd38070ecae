"""Gated multi-head attention and `AttentionPairBias` (AF3 algorithm 24), both through the fused
``torch.ops.spore.triangle_attention`` (pair-bias attention is its ``I = 1`` case), chunked over
queries so neither the pair bias nor the logits exist for all queries at once."""

from __future__ import annotations

import torch
from torch import Tensor, nn

import spore_kernels  # noqa: F401  (defines torch.ops.spore.triangle_attention)
from sci_protenix.chunking import chunk_recompute, chunked, plan_chunk_size
from sci_protenix.memory_plan import MemoryPlan
from sci_protenix.primitives import (
    Linear,
    broadcast,
    check_channels,
    check_pair_for,
    layer_norm,
)


class GatedAttention(nn.Module):
    """The projections of gated multi-head attention: ``linear_q`` (bias when ``q_bias``),
    ``linear_k``, ``linear_v``, ``linear_g`` (sigmoid gate) and ``linear_o``, for ``num_heads``
    heads of ``c_hidden`` channels each. Parameters as Protenix's ``Attention`` modules (the
    triangle one without ``q`` bias, the AF3 one with; ``linear_o`` starts at zero when
    ``zero_init``); the attention itself is the caller's."""

    def __init__(
        self, c_q: int, c_hidden: int, num_heads: int, q_bias: bool, zero_init: bool = True
    ) -> None:
        super().__init__()
        self.c_hidden = c_hidden
        self.num_heads = num_heads
        width = c_hidden * num_heads
        self.linear_q = Linear(c_q, width, bias=q_bias)
        self.linear_k = Linear(c_q, width, bias=False)
        self.linear_v = Linear(c_q, width, bias=False)
        self.linear_o = Linear(width, c_q, bias=False, init="final" if zero_init else "default")
        self.linear_g = Linear(c_q, width, bias=False, init="gating")

    def heads(self, linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """``linear(x)`` viewed as heads: [..., c_q] -> [..., num_heads, c_hidden]."""
        return linear(x).unflatten(-1, (self.num_heads, self.c_hidden))

    def qkv(self, q_x: torch.Tensor, kv_x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Queries of ``q_x`` and keys, values of ``kv_x``, each [..., num_heads, c_hidden]."""
        return (
            self.heads(self.linear_q, q_x),
            self.heads(self.linear_k, kv_x),
            self.heads(self.linear_v, kv_x),
        )

    def wrap_up(self, o: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
        """Gate the attention output ``o`` [..., H, c_hidden] by ``q_x`` and project it back."""
        gate = torch.sigmoid(self.heads(self.linear_g, q_x))
        return self.linear_o((o * gate).flatten(-2))


class AdaptiveLayerNorm(nn.Module):
    """AF3 algorithm 26: ``sigmoid(linear_s(s')) * norm(a) + linear_nobias_s(s')``,
    ``s' = layernorm_s(s)``; parameters as Protenix's ``AdaptiveLayerNorm``."""

    def __init__(self, c_a: int = 768, c_s: int = 384) -> None:
        super().__init__()
        self.layernorm_a = layer_norm(c_a, create_scale=False, create_offset=False)
        self.layernorm_s = layer_norm(c_s, create_offset=False)
        self.linear_s = Linear(c_s, c_a, init="final")
        self.linear_nobias_s = Linear(c_s, c_a, bias=False, init="final")

    def forward(self, a: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """``a`` [..., c_a] conditioned on ``s`` [..., c_s]."""
        s = self.layernorm_s(s)
        return torch.sigmoid(self.linear_s(s)) * self.layernorm_a(a) + self.linear_nobias_s(s)


class AttentionPairBias(nn.Module):
    """Multi-head attention over tokens with a per-head bias from the pair tensor (AF3 alg. 24).

    Constructor keywords and parameters as Protenix's ``AttentionPairBias`` (``has_s=False`` is
    the Pairformer's use; ``has_s=True`` adds the adaptive layer norm and the adaLN-Zero output
    gate ``linear_a_last``). ``chunk_size`` (or the plan field ``pair_bias``) is the number of
    queries per chunk: the pair bias is made from that many rows of ``z`` at a time. Only global
    attention: Protenix's local (windowed) form, which it runs when both ``n_queries`` and
    ``n_keys`` are given, is not provided; with only one of them given Protenix runs global
    attention, and so does this module.
    """

    plan: MemoryPlan | None = None

    def __init__(
        self,
        has_s: bool = True,
        create_offset_ln_z: bool = False,
        n_heads: int = 16,
        c_a: int = 768,
        c_s: int = 384,
        c_z: int = 128,
        biasinit: float = -2.0,
        cross_attention_mode: bool = False,
    ) -> None:
        super().__init__()
        if n_heads <= 0 or c_a % n_heads:
            raise ValueError(f"c_a ({c_a}) must be a positive multiple of n_heads ({n_heads})")
        self.has_s = has_s
        self.n_heads = n_heads
        self.c_a, self.c_s, self.c_z = c_a, c_s, c_z
        self.create_offset_ln_z = create_offset_ln_z
        self.cross_attention_mode = cross_attention_mode
        if has_s:
            self.layernorm_a = AdaptiveLayerNorm(c_a=c_a, c_s=c_s)
        else:
            self.layernorm_a = layer_norm(c_a)
        if cross_attention_mode:
            self.layernorm_kv = AdaptiveLayerNorm(c_a=c_a, c_s=c_s) if has_s else layer_norm(c_a)
        self.attention = GatedAttention(
            c_a, c_a // n_heads, n_heads, q_bias=True, zero_init=not has_s
        )
        self.layernorm_z = layer_norm(c_z, create_offset=create_offset_ln_z)
        self.linear_nobias_z = Linear(c_z, n_heads, bias=False)
        if has_s:
            self.linear_a_last = Linear(c_s, c_a, init="final")
            nn.init.constant_(self.linear_a_last.bias, biasinit)

    def _norm(self, norm: nn.Module, a: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
        return norm(a, s) if self.has_s else norm(a)

    def forward(
        self,
        a: torch.Tensor,
        s: torch.Tensor | None,
        z: torch.Tensor,
        n_queries: int | None = None,
        n_keys: int | None = None,
        inplace_safe: bool = False,
        chunk_size: int | None = None,
        enable_efficient_fusion: bool = False,
    ) -> torch.Tensor:
        """The attention update of ``a`` [..., N, c_a] with bias from ``z`` [..., N, N, c_z]
        (``s`` [..., N, c_s] when ``has_s``). ``inplace_safe`` and ``enable_efficient_fusion``
        are accepted for Protenix's callers and change nothing (the result is always new).
        Both ``n_queries`` and ``n_keys`` given (non-zero) ask for Protenix's local attention,
        a ``ValueError`` here; one alone is ignored, as Protenix ignores it."""
        if n_queries and n_keys:  # Protenix's own test for local attention
            raise ValueError(
                f"AttentionPairBias: local attention (n_queries={n_queries}, n_keys={n_keys}) "
                f"is not provided here; call it without them for global attention, or keep "
                f"Protenix's module for local attention"
            )
        check_channels("a", a, self.c_a, "[..., N, c_a]", 2, self)
        check_channels("z", z, self.c_z, "[..., N, N, c_z]", 3, self)
        check_pair_for("a", a, z)
        n = a.shape[-2]
        if self.has_s:
            if s is None:
                raise ValueError("AttentionPairBias(has_s=True) needs s [..., N, c_s], got None")
            check_channels("s", s, self.c_s, "[..., N, c_s]", 2, self)
            if s.shape[-2] != n or broadcast(s.shape[:-2], a.shape[:-2]) is None:
                raise ValueError(
                    f"s must be [..., N, c_s] with a's N = {n} and batch dims that broadcast with "
                    f"a's, got s {tuple(s.shape)} for a {tuple(a.shape)}; pass the single "
                    f"representation that goes with a"
                )
        size = plan_chunk_size(self, "pair_bias", chunk_size)
        a_n = self._norm(self.layernorm_a, a, s)
        kv = self._norm(self.layernorm_kv, a_n, s) if self.cross_attention_mode else a_n
        q, k, v = (t.unsqueeze(-4) for t in self.attention.qkv(a_n, kv))  # [..., 1, N, H, D]
        batch = q.shape[:-4]

        def queries(
            sl: slice, rows: Tensor, q: Tensor, k: Tensor, v: Tensor, a_n: Tensor
        ) -> Tensor:
            bias = self.linear_nobias_z(self.layernorm_z(rows)).movedim(-1, -3)
            bias = bias.expand(*batch, *bias.shape[-3:])
            o = torch.ops.spore.triangle_attention(q[..., sl, :, :], k, v, bias, None)
            return self.attention.wrap_up(o.squeeze(-4), a_n[..., sl, :])

        again = chunk_recompute(self, size)
        out = chunked(queries, n, size, -2, args=(z, q, k, v, a_n), recompute=again, split=-3)
        if self.has_s:
            out = torch.sigmoid(self.linear_a_last(s)) * out
        return out
