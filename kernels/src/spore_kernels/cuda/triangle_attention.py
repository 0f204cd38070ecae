"""triangle_attention on CUDA, forward and backward, in Triton (flash-attention style: the
``[*, I, H, J, K]`` logits never exist).

Forward: one program per (query block, (batch, i, head)): an online softmax over key blocks in
base 2 (q scaled by scale * log2 e, bias by log2 e), masked keys at -inf, a row with no key
left stored as zeros. Backward recomputes the rows' base-2 log-sum-exp, kept as two parts (the
row's max and the log of its sum: added, the second is lost beside a max like -1e9 * log2 e,
a masked row's bias), and an fp32 output with the same kernel, and takes ``delta =
rowsum(grad * out)`` of that output in torch (the saved output, rounded to 16 bits, would put
its rounding into every dS of the row), then: dk and dv per (key block, (batch, i, head))
looping over query blocks; dq per (query block, (batch, i, head)) looping over key blocks;
dbias per (query block, key block, (batch, head)) looping over i (no atomics:
deterministic). Every product is an fp32 ``tl.dot`` with
``input_precision="ieee"`` (fp32 compute, as the op's contract and the C++ kernel; no TF32),
outputs rounded once.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from spore_kernels import _checks
from spore_kernels.ops import triangle_attention as op

LOG2E = 1.4426950408889634
BLOCK = 32  # query and key rows per block
MAX_DIM = 256  # head dims above run the reference


@triton.jit
def _logits(
    q,
    k,
    BIAS,
    MASK,
    bias_row,
    mask_row,
    offs_m,
    offs_n,
    nj,
    nk,
    scale2,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
):
    # Base-2 logits of a [BM, BN] tile: (q . k) * scale * log2 e + bias * log2 e; keys past nk
    # or masked are -inf. A finite bias beyond +-FLT_MAX / log2 e (a finfo.min mask) gives
    # +-FLT_MAX, not an inf (as the C++ kernel's bias_vec).
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale2
    keep = offs_n[None, :] < nk
    if HAS_BIAS:
        at = bias_row + offs_m[:, None].to(tl.int64) * nk + offs_n[None, :]
        inside = (offs_m[:, None] < nj) & keep
        raw = tl.load(BIAS + at, mask=inside, other=0.0).to(tl.float32)
        scaled = raw * 1.4426950408889634
        clamped = tl.minimum(tl.maximum(scaled, -3.4028234663852886e38), 3.4028234663852886e38)
        s += tl.where(raw - raw == 0.0, clamped, scaled)
    if HAS_MASK:
        kept = tl.load(MASK + mask_row + offs_n, mask=offs_n < nk, other=0)
        keep = keep & (kept[None, :] != 0)
    return tl.where(keep, s, float("-inf"))


@triton.jit
def _read_keys(MASK, mask_row, offs_n, offs_d, nk, dim, HAS_MASK: tl.constexpr):
    # Where a [BN, BD] tile of k or v is read: inside the keys and the head dim, and the key
    # kept; a masked key's k and v are read as 0 (0 * NaN or inf in padding is NaN).
    ok = (offs_n[:, None] < nk) & (offs_d[None, :] < dim)
    if HAS_MASK:
        kept = tl.load(MASK + mask_row + offs_n, mask=offs_n < nk, other=0)
        ok = ok & (kept[:, None] != 0)
    return ok


@triton.jit
def _tri_attn_fwd(
    Q,
    K,
    V,
    BIAS,
    MASK,
    OUT,
    LSE,
    LOGL,
    ni,
    nj,
    nk,
    heads,
    dim,
    scale2,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    STORE_LSE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
):
    bih = tl.program_id(1).to(tl.int64)
    h = bih % heads
    bi = bih // heads
    b = bi // ni
    row = heads * dim
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    offs_n0 = tl.arange(0, BN)
    q_at = bi * nj * row + h * dim + offs_m[:, None].to(tl.int64) * row + offs_d[None, :]
    q_ok = (offs_m[:, None] < nj) & (offs_d[None, :] < dim)
    q = tl.load(Q + q_at, mask=q_ok, other=0.0).to(tl.float32)
    kv_row = bi * nk * row + h * dim
    bias_row = (b * heads + h) * nj * nk
    mask_row = bi * nk
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BD], tl.float32)
    for start in range(0, nk, BN):
        offs_n = start + offs_n0
        kv_at = kv_row + offs_n[:, None].to(tl.int64) * row + offs_d[None, :]
        kv_ok = _read_keys(MASK, mask_row, offs_n, offs_d, nk, dim, HAS_MASK)
        k = tl.load(K + kv_at, mask=kv_ok, other=0.0).to(tl.float32)
        s = _logits(
            q, k, BIAS, MASK, bias_row, mask_row, offs_m, offs_n, nj, nk, scale2, HAS_BIAS, HAS_MASK
        )
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: keep 2^-inf = 0
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        v = tl.load(V + kv_at, mask=kv_ok, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    tl.store(OUT + q_at, out.to(OUT.dtype.element_ty), mask=q_ok)
    if STORE_LSE:  # each row's max and log2 of its sum; max +inf for a row with no key
        has = l_i > 0
        tl.store(LSE + bih * nj + offs_m, tl.where(has, m_i, float("inf")), mask=offs_m < nj)
        logl = tl.where(has, tl.log2(tl.where(has, l_i, 1.0)), 0.0)
        tl.store(LOGL + bih * nj + offs_m, logl, mask=offs_m < nj)


@triton.jit
def _probs(s, LSE, LOGL, at, ok):
    """exp2(s - max - log2 sum) of a tile of logits, the max taken off first."""
    hi = tl.load(LSE + at, mask=ok, other=float("inf"))
    lo = tl.load(LOGL + at, mask=ok, other=0.0)
    return tl.exp2((s - hi[:, None]) - lo[:, None])


@triton.jit
def _tri_attn_bwd_dkdv(
    Q,
    K,
    V,
    BIAS,
    MASK,
    G,
    LSE,
    LOGL,
    DELTA,
    DK,
    DV,
    ni,
    nj,
    nk,
    heads,
    dim,
    scale,
    scale2,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
):
    bih = tl.program_id(1).to(tl.int64)
    h = bih % heads
    bi = bih // heads
    b = bi // ni
    row = heads * dim
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    offs_m0 = tl.arange(0, BM)
    kv_at = bi * nk * row + h * dim + offs_n[:, None].to(tl.int64) * row + offs_d[None, :]
    kv_ok = (offs_n[:, None] < nk) & (offs_d[None, :] < dim)
    mask_row = bi * nk
    read = _read_keys(MASK, mask_row, offs_n, offs_d, nk, dim, HAS_MASK)
    k = tl.load(K + kv_at, mask=read, other=0.0).to(tl.float32)
    v = tl.load(V + kv_at, mask=read, other=0.0).to(tl.float32)
    q_row = bi * nj * row + h * dim
    bias_row = (b * heads + h) * nj * nk
    dk = tl.zeros([BN, BD], tl.float32)
    dv = tl.zeros([BN, BD], tl.float32)
    for start in range(0, nj, BM):
        offs_m = start + offs_m0
        q_at = q_row + offs_m[:, None].to(tl.int64) * row + offs_d[None, :]
        q_ok = (offs_m[:, None] < nj) & (offs_d[None, :] < dim)
        q = tl.load(Q + q_at, mask=q_ok, other=0.0).to(tl.float32)
        g = tl.load(G + q_at, mask=q_ok, other=0.0).to(tl.float32)
        delta = tl.load(DELTA + bih * nj + offs_m, mask=offs_m < nj, other=0.0)
        s = _logits(
            q, k, BIAS, MASK, bias_row, mask_row, offs_m, offs_n, nj, nk, scale2, HAS_BIAS, HAS_MASK
        )
        p = _probs(s, LSE, LOGL, bih * nj + offs_m, offs_m < nj)
        dv += tl.dot(tl.trans(p), g, input_precision="ieee")
        dp = tl.dot(g, tl.trans(v), input_precision="ieee")
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds), q, input_precision="ieee")
    tl.store(DK + kv_at, (dk * scale).to(DK.dtype.element_ty), mask=kv_ok)
    tl.store(DV + kv_at, dv.to(DV.dtype.element_ty), mask=kv_ok)


@triton.jit
def _tri_attn_bwd_dq(
    Q,
    K,
    V,
    BIAS,
    MASK,
    G,
    LSE,
    LOGL,
    DELTA,
    DQ,
    ni,
    nj,
    nk,
    heads,
    dim,
    scale,
    scale2,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
):
    bih = tl.program_id(1).to(tl.int64)
    h = bih % heads
    bi = bih // heads
    b = bi // ni
    row = heads * dim
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    offs_n0 = tl.arange(0, BN)
    q_at = bi * nj * row + h * dim + offs_m[:, None].to(tl.int64) * row + offs_d[None, :]
    q_ok = (offs_m[:, None] < nj) & (offs_d[None, :] < dim)
    q = tl.load(Q + q_at, mask=q_ok, other=0.0).to(tl.float32)
    g = tl.load(G + q_at, mask=q_ok, other=0.0).to(tl.float32)
    delta = tl.load(DELTA + bih * nj + offs_m, mask=offs_m < nj, other=0.0)
    kv_row = bi * nk * row + h * dim
    bias_row = (b * heads + h) * nj * nk
    mask_row = bi * nk
    dq = tl.zeros([BM, BD], tl.float32)
    for start in range(0, nk, BN):
        offs_n = start + offs_n0
        kv_at = kv_row + offs_n[:, None].to(tl.int64) * row + offs_d[None, :]
        kv_ok = _read_keys(MASK, mask_row, offs_n, offs_d, nk, dim, HAS_MASK)
        k = tl.load(K + kv_at, mask=kv_ok, other=0.0).to(tl.float32)
        v = tl.load(V + kv_at, mask=kv_ok, other=0.0).to(tl.float32)
        s = _logits(
            q, k, BIAS, MASK, bias_row, mask_row, offs_m, offs_n, nj, nk, scale2, HAS_BIAS, HAS_MASK
        )
        p = _probs(s, LSE, LOGL, bih * nj + offs_m, offs_m < nj)
        dp = tl.dot(g, tl.trans(v), input_precision="ieee")
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds, k, input_precision="ieee")
    tl.store(DQ + q_at, (dq * scale).to(DQ.dtype.element_ty), mask=q_ok)


@triton.jit
def _tri_attn_bwd_dbias(
    Q,
    K,
    V,
    BIAS,
    MASK,
    G,
    LSE,
    LOGL,
    DELTA,
    DBIAS,
    ni,
    nj,
    nk,
    heads,
    dim,
    scale2,
    HAS_MASK: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
):
    bh = tl.program_id(2).to(tl.int64)
    h = bh % heads
    b = bh // heads
    row = heads * dim
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    q_ok = (offs_m[:, None] < nj) & (offs_d[None, :] < dim)
    bias_row = bh * nj * nk
    acc = tl.zeros([BM, BN], tl.float32)
    for i in range(0, ni):
        bi = b * ni + i
        bih = bi * heads + h
        q_at = bi * nj * row + h * dim + offs_m[:, None].to(tl.int64) * row + offs_d[None, :]
        kv_at = bi * nk * row + h * dim + offs_n[:, None].to(tl.int64) * row + offs_d[None, :]
        q = tl.load(Q + q_at, mask=q_ok, other=0.0).to(tl.float32)
        g = tl.load(G + q_at, mask=q_ok, other=0.0).to(tl.float32)
        read = _read_keys(MASK, bi * nk, offs_n, offs_d, nk, dim, HAS_MASK)
        k = tl.load(K + kv_at, mask=read, other=0.0).to(tl.float32)
        v = tl.load(V + kv_at, mask=read, other=0.0).to(tl.float32)
        delta = tl.load(DELTA + bih * nj + offs_m, mask=offs_m < nj, other=0.0)
        s = _logits(
            q, k, BIAS, MASK, bias_row, bi * nk, offs_m, offs_n, nj, nk, scale2, True, HAS_MASK
        )
        p = _probs(s, LSE, LOGL, bih * nj + offs_m, offs_m < nj)
        dp = tl.dot(g, tl.trans(v), input_precision="ieee")
        acc += p * (dp - delta[:, None])
    at = bias_row + offs_m[:, None].to(tl.int64) * nk + offs_n[None, :]
    ok = (offs_m[:, None] < nj) & (offs_n[None, :] < nk)
    tl.store(DBIAS + at, acc.to(DBIAS.dtype.element_ty), mask=ok)


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:
    """Contiguous q, k, v, a bias and a uint8 mask (q itself, unread, when not given), and
    (batch, I, J, K, H, D)."""
    q, k, v = (t.contiguous() for t in (q, k, v))
    b = q if bias is None else bias.contiguous()
    m = q if mask is None else mask.contiguous().view(torch.uint8)
    return q, k, v, b, m


def _dims(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    *batch, i, j, h, d = q.shape
    return math.prod(batch), i, j, k.shape[-3], h, d


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _lse_and_out(
    q, k, v, b, m, has_bias, has_mask, scale2
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's base-2 log-sum-exp in two parts, its max and log2 of its sum, each
    ``[batch * I * H, J]`` (fp32; max +inf for no key), and the output in fp32."""
    nb, ni, nj, nk, heads, d = _dims(q, k)
    lse, logl = torch.empty(2, nb * ni * heads, nj, dtype=torch.float32, device=q.device)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(nj, BLOCK), nb * ni * heads)
    _tri_attn_fwd[grid](
        q, k, v, b, m, out, lse, logl, ni, nj, nk, heads, d, scale2, has_bias, has_mask, True,
        BM=BLOCK, BN=BLOCK, BD=_block_d(d),
    )  # fmt: skip
    return lse, logl, out


def triangle_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    op.check(q, k, v, bias, mask, scale)
    qc, kc, vc, b, m = _prepare(q, k, v, bias, mask)
    nb, ni, nj, nk, heads, d = _dims(q, k)
    out = torch.empty_like(qc)
    scale2 = op.default_scale(q, scale) * LOG2E
    grid = (triton.cdiv(nj, BLOCK), nb * ni * heads)
    _tri_attn_fwd[grid](
        qc, kc, vc, b, m, out, out, out, ni, nj, nk, heads, d, scale2, bias is not None,
        mask is not None, False, BM=BLOCK, BN=BLOCK, BD=_block_d(d),
    )  # fmt: skip
    return out


def triangle_attention_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    out: torch.Tensor,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    op.check_backward(grad, q, k, v, bias, mask, out, scale)
    qc, kc, vc, b, m = _prepare(q, k, v, bias, mask)
    g = grad.contiguous()
    nb, ni, nj, nk, heads, d = _dims(q, k)
    c = op.default_scale(q, scale)
    has_bias, has_mask = bias is not None, mask is not None
    lse, logl, out32 = _lse_and_out(qc, kc, vc, b, m, has_bias, has_mask, c * LOG2E)
    # delta = rowsum(grad * out), laid out like lse: [batch * I * H, J]
    delta = (g.float() * out32).sum(-1).reshape(nb * ni, nj, heads).transpose(1, 2)
    delta = delta.reshape(nb * ni * heads, nj).contiguous()
    dq, dk, dv = (torch.empty_like(t) for t in (qc, kc, vc))
    bd = _block_d(d)
    args = (qc, kc, vc, b, m, g, lse, logl, delta)
    sizes = (ni, nj, nk, heads, d)
    _tri_attn_bwd_dkdv[(triton.cdiv(nk, BLOCK), nb * ni * heads)](
        *args, dk, dv, *sizes, c, c * LOG2E, has_bias, has_mask, BM=BLOCK, BN=BLOCK, BD=bd
    )
    _tri_attn_bwd_dq[(triton.cdiv(nj, BLOCK), nb * ni * heads)](
        *args, dq, *sizes, c, c * LOG2E, has_bias, has_mask, BM=BLOCK, BN=BLOCK, BD=bd
    )
    if bias is None:
        return dq, dk, dv, q.new_empty(0)
    dbias = torch.empty_like(b)
    grid = (triton.cdiv(nj, BLOCK), triton.cdiv(nk, BLOCK), nb * heads)
    _tri_attn_bwd_dbias[grid](*args, dbias, *sizes, c * LOG2E, has_mask, BM=BLOCK, BN=BLOCK, BD=bd)
    return dq, dk, dv, dbias


def _ready(tensors: tuple[torch.Tensor | None, ...], mask: torch.Tensor | None) -> bool:
    """One kernel dtype and one device (any strides), elements in q, k, v, D <= MAX_DIM."""
    present = [t for t in tensors if t is not None]
    first = present[0]
    if first.dtype not in _checks.KERNEL_DTYPES or first.shape[-1] > MAX_DIM:
        return False
    if any(t.dtype != first.dtype or t.device != first.device for t in present):
        return False
    if mask is not None and mask.device != first.device:
        return False
    return all(t.numel() > 0 for t in tensors[:3])


def supports(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> bool:
    if not (_ready((q, k, v, bias), mask) and _checks.valid_kernel_scale(scale)):
        return False
    try:
        op.check(q, k, v, bias, mask, scale)
    except (TypeError, ValueError):
        return False
    return True


def supports_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    out: torch.Tensor,
    scale: float | None,
) -> bool:
    if not (_ready((q, k, v, bias, grad, out), mask) and _checks.valid_kernel_scale(scale)):
        return False
    try:
        op.check_backward(grad, q, k, v, bias, mask, out, scale)
    except (TypeError, ValueError):
        return False
    return True


KERNELS = {
    "triangle_attention": (triangle_attention, supports),
    "triangle_attention_backward": (triangle_attention_backward, supports_backward),
}
