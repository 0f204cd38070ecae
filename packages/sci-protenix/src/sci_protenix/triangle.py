"""Triangle updates of the pair tensor z [*, N, N, c_z] (AF3 algorithms 12-15), chunked.

Triangle multiplication, outgoing: ``x_ij = sum_k a_ik b_jk``; incoming: ``x_ij = sum_k a_ki
b_kj`` (``a``, ``b``: gated, masked projections of ``layer_norm_in(z)``), then ``layer_norm_out``,
``linear_z`` and the gate ``sigmoid(linear_g(layer_norm_in(z)))``. Chunked, the outgoing update
is computed ``chunk_size`` output rows ``i`` at a time, each from ``a``'s rows ``i`` made for that
chunk, while ``b`` stays whole ([*, c_hidden, N, N], itself built chunk by chunk); the incoming
update the same on the transposed pair (output columns ``j`` per chunk, ``a`` whole). So only
one projection ever exists at full size, and an output chunk reads nothing but its own rows of
``z`` once the whole projection exists: in-place inference can add each chunk into ``z``.

Triangle attention, starting node: row ``i`` of z attends over its keys ``k`` with the bias
``linear(layer_norm(z))_jk`` shared by all rows; ending node: the same on the transposed pair.
Rows are chunked; each chunk goes through ``torch.ops.spore.triangle_attention``, which never
builds the [N, N, N] logits. The bias ([*, H, N, N]) is whole.
"""

from __future__ import annotations

import operator
import sys

import torch
from torch import Tensor, nn

import spore_kernels  # noqa: F401  (defines torch.ops.spore.triangle_attention)
from sci_protenix.attention import GatedAttention
from sci_protenix.chunking import (
    check_chunk_size,
    chunk_recompute,
    chunked,
    grad_free,
    inplace_requested,
    plan_chunk_size,
)
from sci_protenix.memory_plan import MemoryPlan
from sci_protenix.primitives import Linear, check_channels, check_mask, check_square, layer_norm


def _pair_inputs(
    name: str,
    z: torch.Tensor,
    c: int,
    mask: torch.Tensor | None,
    transpose: bool,
    module: nn.Module,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``z`` [*, N, N, c] and its mask (expanded to [*, N, N]), both transposed when asked."""
    check_channels(name, z, c, "[*, N, N, c]", 3, module)
    check_square(name, z)
    check_mask(mask, z.shape[:-1], "[*, N, N] like the pair tensor without channels")
    if mask is not None:
        mask = mask.expand(z.shape[:-1])
    if transpose:
        z = z.transpose(-2, -3)
        mask = None if mask is None else mask.transpose(-1, -2)
    return z, mask


def kept_keys(mask: torch.Tensor) -> torch.Tensor:
    """Where ``mask`` keeps a key, as bool: True, or a value of at least 1 (Protenix adds
    ``inf * (mask - 1)`` to the logits: at its default inf of 1e9 any value below 1 masks its
    key)."""
    return mask if mask.dtype == torch.bool else mask >= 1


class TriangleMultiplicativeUpdate(nn.Module):
    """Triangle multiplication, outgoing (``_outgoing=True``, alg. 12) or incoming (alg. 13).

    Parameters as Protenix's (``linear_a_p``, ``linear_a_g``, ``linear_b_p``, ``linear_b_g``,
    ``linear_g``, ``linear_z``, ``layer_norm_in``, ``layer_norm_out``). The chunk size is the plan's
    ``tri_mul`` when a plan is set, else ``chunk_size``, else (in-place inference only)
    ``_inplace_chunk_size``.
    """

    plan: MemoryPlan | None = None

    def __init__(self, c_z: int, c_hidden: int, _outgoing: bool = True) -> None:
        super().__init__()
        self.c_z = c_z
        self.c_hidden = c_hidden
        self._outgoing = _outgoing
        self.linear_g = Linear(c_z, c_z, bias=False, init="gating")
        self.linear_z = Linear(c_hidden, c_z, bias=False, init="final")
        self.layer_norm_in = layer_norm(c_z)
        self.layer_norm_out = layer_norm(c_hidden)
        self.linear_a_p = Linear(c_z, c_hidden, bias=False)
        self.linear_a_g = Linear(c_z, c_hidden, bias=False, init="gating")
        self.linear_b_p = Linear(c_z, c_hidden, bias=False)
        self.linear_b_g = Linear(c_z, c_hidden, bias=False, init="gating")

    def _project(self, which: str, zn: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Projection ``which`` ("a" or "b") of normalised pair rows ``zn``, masked by ``mask``."""
        gate = getattr(self, f"linear_{which}_g")(zn)
        p = torch.sigmoid(gate) * getattr(self, f"linear_{which}_p")(zn)
        return p if mask is None else p * mask[..., None].to(p.dtype)

    def forward(
        self,
        z: torch.Tensor,
        mask: torch.Tensor | None = None,
        inplace_safe: bool = False,
        _add_with_inplace: bool = False,
        _inplace_chunk_size: int | None = 256,
        triangle_multiplicative: str = "torch",
        chunk_size: int | None = None,
    ) -> torch.Tensor:
        """The update of ``z`` [*, N, N, c_z] under ``mask`` [*, N, N] (1/True = keep).

        With in-place inference asked for (``inplace_safe`` or ``plan.inplace``) and
        ``_add_with_inplace``, returns ``z + update`` instead, accumulated into ``z`` itself when
        no gradient is needed (Protenix's contract). ``triangle_multiplicative`` (Protenix's
        kernel choice) is accepted and ignored.
        """
        zz, mm = _pair_inputs("z", z, self.c_z, mask, not self._outgoing, self)
        size = plan_chunk_size(self, "tri_mul", chunk_size)
        requested = inplace_requested(self, inplace_safe)
        if size is None and requested:
            size = check_chunk_size(_inplace_chunk_size)
        add = requested and _add_with_inplace
        inplace = add and grad_free(self, z)
        again = chunk_recompute(self, size)
        n = zz.shape[-3]
        whole = self.layer_norm_in(zz) if size is None else None
        # the projection made per chunk of output rows, and the one kept whole
        near, far = ("a", "b") if self._outgoing else ("b", "a")

        def normed(sl: slice, rows: Tensor, whole: Tensor | None) -> Tensor:
            return whole[..., sl, :, :] if whole is not None else self.layer_norm_in(rows)

        def far_piece(sl: slice, zz: Tensor, whole: Tensor | None, mm: Tensor | None) -> Tensor:
            masked = None if mm is None else mm[..., sl, :]
            p = self._project(far, normed(sl, zz, whole), masked)
            return p.movedim(-1, -3).transpose(-1, -2)  # [*, c, K, rows]: right operand

        far_t = chunked(far_piece, n, size, -1, args=(zz, whole, mm), recompute=again, split=-3)

        def rows(
            sl: slice, zz: Tensor, whole: Tensor | None, mm: Tensor | None, far_t: Tensor
        ) -> Tensor:
            zn = normed(sl, zz, whole)
            masked = None if mm is None else mm[..., sl, :]
            p = self._project(near, zn, masked).movedim(-1, -3)  # [*, c, rows, K]
            x = torch.matmul(p, far_t).movedim(-3, -1)  # [*, rows, J, c]
            x = self.linear_z(self.layer_norm_out(x))
            return x * torch.sigmoid(self.linear_g(zn))

        out = chunked(
            rows,
            n,
            size,
            -3,
            args=(zz, whole, mm, far_t),
            out=zz if inplace else None,
            accumulate=inplace,
            recompute=again,
            split=-3,
        )
        if inplace:
            return z
        update = out if self._outgoing else out.transpose(-2, -3)
        return z + update if add else update


def _flag(given: object) -> bool | None:
    """``given`` as a bool when it is one: a bool, a numpy bool or an integer 0 or 1 (Protenix
    takes any of them by truth value); None for anything else (a float, say)."""
    if isinstance(given, bool):
        return given
    np = sys.modules.get("numpy")  # a numpy bool means numpy is loaded: no import needed
    if np is not None and isinstance(given, np.bool_):
        return bool(given)
    try:
        value = operator.index(given)  # type: ignore[arg-type]
    except TypeError:
        return None
    return bool(value) if value in (0, 1) else None


def check_fixed(
    module: nn.Module, keyword: str, given: object, fixed: bool, other: str, position: str
) -> None:
    """A ValueError unless ``given`` is a flag (:func:`_flag`) equal to ``fixed``, the value of
    Protenix's constructor keyword ``keyword`` (its ``position`` positional argument: "3rd",
    "4th") that ``module``'s class stands for (``other``: the class for the other value)."""
    flag = _flag(given)
    name = type(module).__name__
    if flag is None:
        hint = "; pass inf= by keyword" if keyword == "starting" else ""
        raise ValueError(
            f"{name}: the {position} positional argument is {keyword} (Protenix's order), a "
            f"bool, got {given!r}{hint}"
        )
    if flag is not fixed:
        raise ValueError(
            f"{name} takes {keyword}={fixed} only (the class fixes it), got "
            f"{keyword}={given!r}; for {keyword}={not fixed} build {other}"
        )


class TriangleMultiplicationOutgoing(TriangleMultiplicativeUpdate):
    """Triangle multiplication using outgoing edges (AF3 algorithm 12); ``_outgoing`` (Protenix's
    keyword) must be True."""

    def __init__(self, c_z: int, c_hidden: int, _outgoing: bool = True) -> None:
        check_fixed(self, "_outgoing", _outgoing, True, "TriangleMultiplicationIncoming", "3rd")
        super().__init__(c_z, c_hidden, _outgoing=True)


class TriangleMultiplicationIncoming(TriangleMultiplicativeUpdate):
    """Triangle multiplication using incoming edges (AF3 algorithm 13); ``_outgoing`` (Protenix's
    keyword) must be False."""

    def __init__(self, c_z: int, c_hidden: int, _outgoing: bool = False) -> None:
        check_fixed(self, "_outgoing", _outgoing, False, "TriangleMultiplicationOutgoing", "3rd")
        super().__init__(c_z, c_hidden, _outgoing=False)


class TriangleAttention(nn.Module):
    """Triangle self-attention around the starting node (``starting=True``, alg. 14) or the
    ending node (alg. 15), ``no_heads`` heads of ``c_hidden`` channels.

    Parameters as Protenix's (``layer_norm``, ``linear`` for the bias, ``mha.linear_q/k/v/g/o``).
    The chunk size (rows of z per chunk) is the plan's ``tri_att`` when a plan is set, else
    ``chunk_size``. A key is masked where the mask is False or below 1 (:func:`kept_keys`: a
    soft value masks, as in Protenix). ``inf`` is kept for Protenix's constructor: masking here
    is exact (masked keys get zero weight; a row with every key masked gives a zero update
    where Protenix's ``-inf``-bias gives the mean of its values).
    """

    plan: MemoryPlan | None = None

    def __init__(
        self, c_in: int, c_hidden: int, no_heads: int, starting: bool = True, inf: float = 1e9
    ) -> None:
        super().__init__()
        self.c_in = c_in
        self.c_hidden = c_hidden
        self.no_heads = no_heads
        self.starting = starting
        self.inf = inf
        self.layer_norm = layer_norm(c_in)
        self.linear = Linear(c_in, no_heads, bias=False)
        self.mha = GatedAttention(c_in, c_hidden, no_heads, q_bias=False)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        chunk_size: int | None = None,
        triangle_attention: str = "torch",
        inplace_safe: bool = False,
        _add_with_inplace: bool = False,
    ) -> torch.Tensor:
        """The update of the pair tensor ``x`` [*, I, J, c_in] under ``mask`` [*, I, J] (True or
        1 = keep; False or any value below 1 = masked).

        With in-place inference asked for (``inplace_safe`` or ``plan.inplace``) and
        ``_add_with_inplace``, returns ``x + update``, accumulated into ``x`` itself when no
        gradient is needed. ``triangle_attention`` (Protenix's kernel choice) is ignored.
        """
        xx, mm = _pair_inputs("x", x, self.c_in, mask, not self.starting, self)
        size = plan_chunk_size(self, "tri_att", chunk_size)
        add = _add_with_inplace and inplace_requested(self, inplace_safe)
        inplace = add and grad_free(self, x)
        again = chunk_recompute(self, size)
        n = xx.shape[-3]
        whole = self.layer_norm(xx) if size is None else None

        def normed(sl: slice, rows: Tensor, whole: Tensor | None) -> Tensor:
            return whole[..., sl, :, :] if whole is not None else self.layer_norm(rows)

        def bias_piece(sl: slice, xx: Tensor, whole: Tensor | None) -> Tensor:
            # bias[*, h, j, k] = linear(x_jk)_h, shared by every row i
            return self.linear(normed(sl, xx, whole)).movedim(-1, -3)

        bias = chunked(bias_piece, n, size, -2, args=(xx, whole), recompute=again, split=-3)
        keep = None if mm is None else kept_keys(mm)

        def rows(
            sl: slice, xx: Tensor, whole: Tensor | None, bias: Tensor, keep: Tensor | None
        ) -> Tensor:
            xn = normed(sl, xx, whole)
            q, k, v = self.mha.qkv(xn, xn)
            m = None if keep is None else keep[..., sl, :]
            o = torch.ops.spore.triangle_attention(q, k, v, bias, m)
            return self.mha.wrap_up(o, xn)

        out = chunked(
            rows,
            n,
            size,
            -3,
            args=(xx, whole, bias, keep),
            out=xx if inplace else None,
            accumulate=inplace,
            recompute=again,
            split=-3,
        )
        if inplace:
            return x
        update = out if self.starting else out.transpose(-2, -3)
        return x + update if add else update


class TriangleAttentionStartingNode(TriangleAttention):
    """Triangle attention around the starting node (AF3 algorithm 14); ``starting`` (Protenix's
    keyword) must be True."""

    def __init__(
        self, c_in: int, c_hidden: int, no_heads: int, starting: bool = True, inf: float = 1e9
    ) -> None:
        check_fixed(self, "starting", starting, True, "TriangleAttentionEndingNode", "4th")
        super().__init__(c_in, c_hidden, no_heads, starting=True, inf=inf)


class TriangleAttentionEndingNode(TriangleAttention):
    """Triangle attention around the ending node (AF3 algorithm 15); ``starting`` (Protenix's
    keyword) must be False."""

    def __init__(
        self, c_in: int, c_hidden: int, no_heads: int, starting: bool = False, inf: float = 1e9
    ) -> None:
        check_fixed(self, "starting", starting, False, "TriangleAttentionStartingNode", "4th")
        super().__init__(c_in, c_hidden, no_heads, starting=False, inf=inf)
