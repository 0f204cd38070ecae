"""``block_sparse_attention(q, k, v, kv_block_index, kv_block_count, block_size, scale=None)``.

Layout contract: q is ``(B, H, Sq, D)``, k and v are ``(B, H, Skv, D)`` (one head count: callers
expand grouped heads), all of one float dtype; the output is ``(B, H, Sq, D)`` in q's dtype.
Query block i is rows ``[i*bs, min((i+1)*bs, Sq))`` and KV block j is keys
``[j*bs, min((j+1)*bs, Skv))`` (the last blocks may be short). ``kv_block_index`` is int32 or
int64 of shape ``(B, H, ceil(Sq/bs), M)``; its first ``kv_block_count[b, h, i]`` entries (0..M,
same int dtype, shape ``(B, H, ceil(Sq/bs))``) list the distinct KV blocks, in any order, that
query block i attends to. Entries past the count are ignored.

Numerics contract: an exact softmax over the listed keys, ``softmax(q k^T * scale) v`` with
``scale`` defaulting to ``1/sqrt(D)``, computed in float32 (float64 stays float64) and rounded
once to q's dtype. A query block that lists no KV block gets zeros.

Bad input (non-float or mixed dtypes, wrong index dtype or shape, a count outside 0..M, an id
outside 0..ceil(Skv/bs)-1 or listed twice) raises TypeError/ValueError before any kernel runs.

The C++ CPU kernel takes contiguous CPU q, k, v of one dtype (float32, bfloat16, float16) and
CPU block lists (copied when not contiguous): per (batch x head, query block), an online
softmax over the listed blocks in register tiles, fp32 accumulation. Anything else runs the
reference.

Backward: none of its own; autograd differentiates the reference (``spore.dispatch``'s
default, recomputed in backward), for q, k and v.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from spore_kernels import _checks, _lib

SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor kv_block_index, Tensor kv_block_count, "
    "int block_size, float? scale=None) -> Tensor"
)
OP = "block_sparse_attention"
INDEX_DTYPES = (torch.int32, torch.int64)
CHUNK_ELEMENTS = 1 << 24
"""The reference scores query blocks in chunks of at most this many (query, key) pairs (or one
query block of every head, when that alone is more): bounded memory."""


def blocks(n: int, block_size: int) -> int:
    """How many blocks of ``block_size`` cover ``n`` positions (the last one may be short)."""
    return -(-n // block_size)


def check_index(
    kv_block_index: torch.Tensor,
    kv_block_count: torch.Tensor,
    block_size: int,
    sq: int,
    skv: int,
    batch: tuple[int, int] | None = None,
) -> None:
    """Clear errors for block lists that do not describe ``sq`` queries over ``skv`` keys.

    Reads the counts and the listed ids (a device sync on accelerators).
    """
    check_index_meta(kv_block_index, kv_block_count, block_size, sq, batch)
    m = kv_block_index.shape[-1]
    counts = kv_block_count.to(torch.int64)
    if counts.numel():
        low, high = int(counts.min()), int(counts.max())
        if low < 0 or high > m:
            raise ValueError(
                f"{OP}: kv_block_count must lie in 0..{m} (kv_block_index's last dimension), "
                f"got values from {low} to {high}"
            )
    listed = torch.arange(m, device=counts.device) < counts.unsqueeze(-1)
    ids = kv_block_index.to(torch.int64)
    valid_ids = ids[listed]
    if valid_ids.numel() == 0:
        return
    nk = blocks(skv, block_size)
    low, high = int(valid_ids.min()), int(valid_ids.max())
    if low < 0 or high >= nk:
        raise ValueError(
            f"{OP}: listed KV block ids must lie in 0..{nk - 1} (ceil(Skv / block_size) = "
            f"ceil({skv} / {block_size}) blocks), got ids from {low} to {high}"
        )
    # Distinct: unlisted entries become distinct ids past the last block; sorted, no two
    # neighbours may be equal.
    ordered = torch.where(listed, ids, nk + torch.arange(m, device=ids.device)).sort(-1).values
    repeats = ordered[..., 1:] == ordered[..., :-1]
    if bool(repeats.any()):
        where = repeats.nonzero()[0].tolist()
        raise ValueError(
            f"{OP}: the KV blocks listed for each query block must be distinct; query block "
            f"{tuple(where[:-1])} (batch, head, block) lists one twice"
        )


def check_index_meta(
    kv_block_index: torch.Tensor,
    kv_block_count: torch.Tensor,
    block_size: int,
    sq: int,
    batch: tuple[int, int] | None = None,
) -> None:
    """The dtype and shape errors of :func:`check_index` (no data read)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"{OP}: block_size must be a positive int, got {block_size!r}")
    _checks.strided(OP, kv_block_index=kv_block_index, kv_block_count=kv_block_count)
    if kv_block_index.dtype not in INDEX_DTYPES:
        raise TypeError(f"{OP}: kv_block_index must be int32 or int64, got {kv_block_index.dtype}")
    if kv_block_count.dtype != kv_block_index.dtype:
        raise TypeError(
            f"{OP}: kv_block_count must have kv_block_index's dtype ({kv_block_index.dtype}), "
            f"got {kv_block_count.dtype}"
        )
    nq = blocks(sq, block_size)
    if kv_block_index.dim() != 4 or kv_block_index.shape[2] != nq:
        raise ValueError(
            f"{OP}: kv_block_index must have shape (B, H, ceil(Sq / block_size) = {nq}, M), "
            f"got {tuple(kv_block_index.shape)}"
        )
    lead = tuple(kv_block_index.shape[:2]) if batch is None else batch
    if tuple(kv_block_index.shape[:2]) != lead:
        raise ValueError(
            f"{OP}: kv_block_index must have shape ({lead[0]}, {lead[1]}, {nq}, M) for q's "
            f"(B, H), got {tuple(kv_block_index.shape)}"
        )
    if tuple(kv_block_count.shape) != (*lead, nq):
        raise ValueError(
            f"{OP}: kv_block_count must have shape {(*lead, nq)} (B, H, ceil(Sq / block_size)), "
            f"got {tuple(kv_block_count.shape)}"
        )
    _checks.same_device(OP, kv_block_index=kv_block_index, kv_block_count=kv_block_count)


def check_meta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_block_index: torch.Tensor,
    kv_block_count: torch.Tensor,
    block_size: int,
    scale: float | None,
) -> None:
    """Every error that needs no tensor data: dtypes, shapes, devices, block size, scale."""
    _checks.floating(OP, q=q, k=k, v=v)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(
            f"{OP}: q, k and v must have one dtype, got {q.dtype}, {k.dtype} and {v.dtype}; "
            f"convert them to one"
        )
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"{OP}: q, k and v must be 4-D (B, H, S, D), got shapes {tuple(q.shape)}, "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(
            f"{OP}: k and v must have shape (B, H, Skv, D) with q's B, H and D (expand grouped "
            f"heads first), got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    _checks.scale(OP, scale)
    _checks.same_device(OP, q=q, k=k, v=v, kv_block_index=kv_block_index)
    check_index_meta(kv_block_index, kv_block_count, block_size, q.shape[2], tuple(q.shape[:2]))


def check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_block_index: torch.Tensor,
    kv_block_count: torch.Tensor,
    block_size: int,
    scale: float | None,
) -> None:
    """Clear errors for the inputs block_sparse_attention cannot take (reads counts and ids,
    except while traced: a compiled graph's backward reruns the reference on fake tensors,
    whose values the forward's call checked when it ran)."""
    check_meta(q, k, v, kv_block_index, kv_block_count, block_size, scale)
    if not is_fake(kv_block_index) and not is_fake(kv_block_count):
        check_index(kv_block_index, kv_block_count, block_size, q.shape[2], k.shape[2])


def dense_block_table(
    kv_block_index: torch.Tensor, kv_block_count: torch.Tensor, nk: int
) -> torch.Tensor:
    """The bool ``(B, H, nq, nk)`` table of the (query block, KV block) pairs listed (lists
    already checked against ``nk`` KV blocks)."""
    b, h, nq, m = kv_block_index.shape
    listed = torch.arange(m, device=kv_block_index.device) < kv_block_count.unsqueeze(-1)
    ids = torch.where(listed, kv_block_index.to(torch.int64), nk)  # unlisted: a spare column
    table = torch.zeros(b, h, nq, nk + 1, dtype=torch.bool, device=kv_block_index.device)
    return table.scatter_(-1, ids, True)[..., :nk]


def dense_mask(
    kv_block_index: torch.Tensor,
    kv_block_count: torch.Tensor,
    block_size: int,
    sq: int,
    skv: int,
) -> torch.Tensor:
    """The bool ``(B, H, sq, skv)`` mask of the (query, key) pairs the block lists allow."""
    check_index(kv_block_index, kv_block_count, block_size, sq, skv)
    table = dense_block_table(kv_block_index, kv_block_count, blocks(skv, block_size))
    rows = table.repeat_interleave(block_size, dim=2)[:, :, :sq]
    return rows.repeat_interleave(block_size, dim=3)[..., :skv]


def span(block_size: int, sq: int, skv: int) -> int:
    """``block_size`` capped at the longer sequence: a longer block covers the same positions
    (one block each way), and the work space grows with the block (block_size 16384 over 100
    tokens took 2.3 GB)."""
    return min(block_size, max(sq, skv, 1))


def _default_scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_block_index: torch.Tensor,
    kv_block_count: torch.Tensor,
    block_size: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Gathers each query block's listed KV blocks and takes an exact softmax over them."""
    check(q, k, v, kv_block_index, kv_block_count, block_size, scale)
    compute = _checks.compute_dtype(q)
    b, h, sq, d = q.shape
    skv = k.shape[2]
    bs = span(block_size, sq, skv)
    nq, nk, m = blocks(sq, bs), blocks(skv, bs), kv_block_index.shape[-1]
    out = q.new_zeros(b, h, nq * bs, d, dtype=compute)
    if b * h == 0 or sq == 0 or m == 0 or d == 0 or nk == 0:  # nothing listed or to attend to
        unread = sum(t.narrow(2, 0, 0).sum() for t in (q, k, v))  # zero gradients, not None
        return (out[:, :, :sq] + unread).to(q.dtype).contiguous()  # as the fake
    qf = _pad(q.to(compute), nq * bs).view(b, h, nq, bs, d)
    kf = _pad(k.to(compute), nk * bs).reshape(b * h, nk, bs, d)  # (B, S, H, D) transposed too
    vf = _pad(v.to(compute), nk * bs).reshape(b * h, nk, bs, d)
    listed = torch.arange(m, device=q.device) < kv_block_count.to(torch.int64).unsqueeze(-1)
    ids = torch.where(listed, kv_block_index.to(torch.int64), 0).reshape(b * h, nq, m)
    heads = torch.arange(b * h, device=q.device).view(-1, 1, 1)
    within = torch.arange(bs, device=q.device)
    # keys that exist: a listed block, and inside the sequence (the last block may be short)
    key_ok = listed.reshape(b * h, nq, m, 1) & (ids.unsqueeze(-1) * bs + within < skv)
    scale = _default_scale(q, scale)
    step = max(1, CHUNK_ELEMENTS // (b * h * bs * m * bs))
    parts = []
    for i0 in range(0, nq, step):
        sl = slice(i0, min(i0 + step, nq))
        # an unlisted slot holds block 0: zeroed, so that its NaN or inf reaches no row
        # (0 * NaN in p @ v) and no gradient
        off = ~key_ok[:, sl].flatten(2, 3)  # (B*H, n, M*bs)
        kg = kf[heads, ids[:, sl]].flatten(2, 3).masked_fill(off.unsqueeze(-1), 0.0)
        vg = vf[heads, ids[:, sl]].flatten(2, 3).masked_fill(off.unsqueeze(-1), 0.0)
        qc = qf[:, :, sl].reshape(b * h, -1, bs, d)
        s = torch.matmul(qc, kg.transpose(-1, -2)) * scale  # (B*H, n, bs, M*bs)
        s = s.masked_fill(off.unsqueeze(2), float("-inf"))
        top = s.amax(-1, keepdim=True).detach()
        p = torch.exp(s - torch.where(torch.isinf(top), 0.0, top))
        total = p.sum(-1, keepdim=True)
        part = torch.matmul(p, vg) / torch.where(total > 0, total, 1.0)
        parts.append(part)
    out = torch.cat(parts, dim=1).view(b, h, nq * bs, d)
    return out[:, :, :sq].to(q.dtype).contiguous()  # as the fake


def _pad(x: torch.Tensor, length: int) -> torch.Tensor:
    """x padded with zero rows along the sequence dimension to ``length``."""
    extra = length - x.shape[2]
    return torch.nn.functional.pad(x, (0, 0, 0, extra)) if extra else x


def _fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_block_index: torch.Tensor,
    kv_block_count: torch.Tensor,
    block_size: int,
    scale: float | None = None,
) -> torch.Tensor:
    check_meta(q, k, v, kv_block_index, kv_block_count, block_size, scale)
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def supports(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_block_index: torch.Tensor,
    kv_block_count: torch.Tensor,
    block_size: int,
    scale: float | None = None,
) -> bool:
    """Contiguous CPU q, k, v of one kernel dtype and CPU block lists of valid dtypes and
    shapes (the lists' values are checked by :func:`cpu`, which makes them contiguous), a
    scale the kernel takes (:func:`spore_kernels._checks.valid_kernel_scale`)."""
    if not (
        _checks.ready(q, k, v, device_type="cpu")
        and kv_block_index.is_cpu
        and kv_block_count.is_cpu
        and _checks.valid_kernel_scale(scale)
    ):
        return False
    try:
        check_meta(q, k, v, kv_block_index, kv_block_count, block_size, scale)
    except (TypeError, ValueError):
        return False
    return True


_ARGS = (*(_lib.ptr,) * 6, *(_lib.i64,) * 6, _lib.f32, *(_lib.i32,) * 3)


def cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_block_index: torch.Tensor,
    kv_block_count: torch.Tensor,
    block_size: int,
    scale: float | None = None,
) -> torch.Tensor:
    """The C++ kernel, after the same checks as the reference (the lists' values included).

    Inputs are made contiguous (for q, k, v a no-op when :func:`supports` accepted them): the
    library reads them as dense arrays."""
    check(q, k, v, kv_block_index, kv_block_count, block_size, scale)
    _checks.kernel_scale(OP, scale)
    if not q.is_cpu or q.dtype not in _checks.KERNEL_DTYPES:
        raise ValueError(
            f"{OP}: the CPU kernel takes float32/bfloat16/float16 CPU tensors, got {q.dtype} on "
            f"{q.device}; call torch.ops.spore.{OP}, which picks a kernel or the reference"
        )
    b, h, sq, d = q.shape
    out = torch.empty(b, h, sq, d, dtype=q.dtype)
    if out.numel() == 0:
        return out
    ptrs = (*(t.contiguous() for t in (q, k, v, kv_block_index, kv_block_count)), out)
    sizes = (b * h, sq, k.shape[2], d, kv_block_index.shape[-1], span(block_size, sq, k.shape[2]))
    wide = int(kv_block_index.dtype == torch.int64)
    codes = (wide, _lib.dtype_code(q), _lib.threads())
    args = (*(t.data_ptr() for t in ptrs), *sizes, _default_scale(q, scale), *codes)
    _lib.call("spore_block_sparse_attention", _ARGS, *args)
    return out


def register(registry: Any) -> None:
    """Define the op with its reference (autograd: the reference's gradient) and CPU kernel."""
    fwd = registry.define(OP, SCHEMA, reference=reference, fake=_fake)
    registry.kernel(fwd, "cpu", cpu, priority=_checks.PRIORITY, supports=supports)


def benchmarks() -> list[Any]:
    return []
