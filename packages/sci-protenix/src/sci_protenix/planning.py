"""Memory plans from a budget: an analytic model of each Pairformer module's memory.

The model counts, per module, the elements of the tensors sci-protenix's modules make (read
off their code: which projections exist at once, which autograd keeps), as functions of the
token count N, the chunk size c (rows of N positions) and the channel widths:

- ``work``: what a forward holds above its input while it runs (its output included);
- ``saved``: what autograd keeps from the forward until backward (training);
- ``backward``: what the module's backward holds on top of that while it runs.

Under ``MemoryPlan.recompute == "block"`` every pair module reruns in its own backward (a
chunked one one chunk at a time): a module keeps nothing but its input, and its ``backward``
is all it holds while its own backward runs. :func:`predict_peak` adds these up like
the block does: the residual pair tensors, every module's saved tensors, the parameters'
gradients, and the largest transient. :func:`plan` picks the largest chunk sizes (and, in
training, the recompute) whose prediction, plus the resident weights and inputs, fits a budget.
The figures are estimates: the tests hold them within a stated factor of
``spore.memory.peak`` measurements.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Literal

import torch

from sci_protenix.budget import format_bytes, parse_budget
from sci_protenix.memory_plan import MemoryPlan

PairKind = Literal["tri_mul", "tri_att", "transition", "pair_bias"]
KINDS: tuple[PairKind, ...] = ("tri_mul", "tri_att", "transition", "pair_bias")
INPLACE_KINDS = ("tri_mul", "tri_att", "transition")  # chunks added into z in place


@dataclass(frozen=True)
class Dims:
    """The widths of a Pairformer block (Protenix's names and defaults)."""

    c_z: int = 128
    c_s: int = 384
    n_heads: int = 16
    pair_heads: int = 4
    c_hidden_mul: int = 128
    c_hidden_pair_att: int = 32
    transition_n: int = 4
    n_blocks: int = 1
    batch: int = 1

    def check(self) -> None:
        for name, value in self.__dict__.items():
            minimum = 0 if name == "c_s" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
        if self.c_s and self.c_s % self.n_heads:
            raise ValueError(f"c_s ({self.c_s}) must be a multiple of n_heads ({self.n_heads})")


@dataclass(frozen=True)
class ModuleMemory:
    """Elements one module holds (see the module doc): forward work, saved, backward."""

    work: int
    saved: int
    backward: int


def _module(kind: PairKind, n: int, c: int | None, d: Dims, recompute: bool) -> ModuleMemory:
    """One pair module's elements at chunk size ``c`` (None: whole) over the batch. The
    triangle modules and pair-bias attention chunk each sequence's rows; the transition chunks
    the batch's rows flattened (a chunk of ``c`` rows of N positions, whatever the batch)."""
    flat = kind == "transition"
    whole = c is None or c >= (d.batch * n if flat else n)
    e = d.batch * n * n  # pair positions
    r = e if whole else c * n * (1 if flat else d.batch)  # positions in one chunk
    cz, ch = d.c_z, d.c_hidden_mul
    a = d.pair_heads * d.c_hidden_pair_att
    hid = d.transition_n * cz
    if kind == "tri_mul":
        # layer-normed z, a and b (gate, projection, masked), the product, its norm, out, gate;
        # a forward's most is either while the near projection is made beside the far one
        # (gate, its sigmoid, the projection, their product: wide c_hidden) or while the
        # output is gated (wide c_z), measured on the module (chunked: bounds, 1-1.1x)
        per = 3 * cz + 8 * ch
        if whole:
            work = e * max(cz + 5 * ch, 4 * cz + 2 * ch)
        else:
            work = e * (ch + cz) + r * max(5 * cz + ch, 2 * cz + 9 * ch // 2)
        if whole:
            return _rerun(ModuleMemory(work, e * per, e * 3 * cz), e * cz, recompute)
        if recompute:  # the far projection, its gradient and the next one, the input's gradient
            return ModuleMemory(work, 0, e * (3 * ch + 2 * cz) + r * per)
        return ModuleMemory(work, e * (per + cz), e * (cz + 2 * ch) + r * 3 * cz)
    if kind == "tri_att":
        # layer-normed z, q, k, v, gate, attention out, gated out; bias [H, N, N]; chunked,
        # also the chunk's update beside them and the mask as bool (counted as e elements)
        per = cz + 6 * a
        work = e * (2 * cz + 6 * a) if whole else e * (cz + d.pair_heads + 1) + r * (3 * cz + 6 * a)
        if whole:
            whole_mem = ModuleMemory(work, e * (per + d.pair_heads), e * (cz + 3 * a))
            return _rerun(whole_mem, e * cz, recompute)
        if recompute:  # the bias and its gradients, the input's gradient
            return ModuleMemory(work, 0, e * (2 * cz + 3 * d.pair_heads) + r * per)
        return ModuleMemory(work, e * (per + cz + d.pair_heads), e * (cz + 3 * a))
    if kind == "transition":
        # layer-normed z, the two hidden projections, silu, their product (chunked: and the
        # chunk's update beside them)
        per = cz + 4 * hid
        work = e * (cz + 3 * hid) if whole else e * cz + r * (2 * cz + 3 * hid)
        if whole:
            return _rerun(ModuleMemory(work, e * per, e * (cz + 2 * hid)), e * cz, recompute)
        if recompute:
            return ModuleMemory(work, 0, e * 2 * cz + r * per)
        return ModuleMemory(work, e * per, e * 2 * cz + r * (cz + 2 * hid))
    # pair_bias: AttentionPairBias's layer-normed z rows and bias [H, rows, N]; the rest is O(N)
    if d.c_s == 0:
        return ModuleMemory(0, 0, 0)
    per = cz + d.n_heads
    tokens = d.batch * n * d.c_s
    work = r * per + 4 * tokens
    if not whole and recompute:
        return ModuleMemory(work, 4 * tokens, e * 2 * cz + r * per + 4 * tokens)
    return ModuleMemory(work, e * per + 7 * tokens, e * per + 4 * tokens)


def _rerun(whole: ModuleMemory, gathered: int, recompute: bool) -> ModuleMemory:
    """A whole module under "block" recompute: it reruns in its own backward, so what it saves
    exists only then, with the gradient of its input (``gathered``)."""
    if not recompute:
        return whole
    return ModuleMemory(whole.work, 0, whole.saved + whole.backward + gathered)


def _single(n: int, d: Dims) -> ModuleMemory:
    """The single transition over the batch (O(N), one row per sequence: counted whole)."""
    hid, t = 4 * d.c_s, d.batch * n
    return ModuleMemory(t * (d.c_s + 3 * hid), t * (d.c_s + 4 * hid), t * (d.c_s + 2 * hid))


def parameter_count(d: Dims) -> int:
    """Parameters of ``n_blocks`` PairformerBlocks (built on the meta device, so exact)."""
    return d.n_blocks * _block_parameters(replace(d, n_blocks=1, batch=1))


@lru_cache(maxsize=32)
def _block_parameters(d: Dims) -> int:
    from sci_protenix.pairformer import PairformerBlock

    with torch.device("meta"):
        block = PairformerBlock(
            n_heads=d.n_heads,
            c_z=d.c_z,
            c_s=d.c_s,
            c_hidden_mul=d.c_hidden_mul,
            c_hidden_pair_att=d.c_hidden_pair_att,
            no_heads_pair=d.pair_heads,
            num_intermediate_factor=d.transition_n,
        )
    return sum(p.numel() for p in block.parameters())


def _whole(plan: MemoryPlan, kind: str, n: int, d: Dims) -> bool:
    size = getattr(plan, kind, None)
    return size is None or size >= (d.batch * n if kind == "transition" else n)


def _kinds(mods: list[ModuleMemory]) -> list[tuple[str, ModuleMemory]]:
    """``mods`` (as :func:`_modules` orders them) with their plan field."""
    names = ["tri_mul", "tri_mul", "tri_att", "tri_att", "transition", "pair_bias", "single"]
    return list(zip(names, mods, strict=False))


def _modules(n: int, plan: MemoryPlan, d: Dims, training: bool) -> list[ModuleMemory]:
    recompute = training and plan.recompute == "block"
    chunks = {kind: getattr(plan, kind) for kind in KINDS}
    mods = [_module(k, n, chunks[k], d, recompute) for k in ("tri_mul", "tri_mul")]
    mods += [_module("tri_att", n, chunks["tri_att"], d, recompute) for _ in range(2)]
    mods.append(_module("transition", n, chunks["transition"], d, recompute))
    if d.c_s:
        mods += [_module("pair_bias", n, chunks["pair_bias"], d, recompute), _single(n, d)]
    return mods


def predict_peak(
    tokens: int,
    plan: MemoryPlan,
    *,
    training: bool = False,
    dtype: torch.dtype = torch.float32,
    dims: Dims | None = None,
) -> int:
    """Predicted peak bytes a Pairformer forward (or, ``training``, forward + backward) allocates
    under ``plan``: what ``spore.memory.peak`` measures around it (activations, outputs and
    parameter gradients; not the weights and inputs, see :func:`resident_bytes`)."""
    d = dims or Dims()
    d.check()
    _check_tokens(tokens)
    size = torch.empty((), dtype=dtype).element_size()
    n, e = tokens, tokens * tokens
    mods = _modules(n, plan, d, training)
    z, s = d.batch * e * d.c_z, d.batch * n * d.c_s  # the mods' figures are the batch's too
    if not training:
        if plan.inplace:  # every update is added into the caller's z: no new pair tensor
            chunked_work = [
                m.work - z if k in INPLACE_KINDS and not _whole(plan, k, n, d) else m.work
                for k, m in _kinds(mods)
            ]
            return size * (2 * s + max(chunked_work))
        return size * (2 * z + 2 * s + max(m.work for m in mods))
    block_saved = sum(m.saved for m in mods) + 4 * z + 2 * s  # + the residual sums
    grads = parameter_count(d)
    segments = -(-d.n_blocks // plan.blocks_per_checkpoint)
    per = min(plan.blocks_per_checkpoint, d.n_blocks)  # the blocks a segment can hold
    if plan.recompute == "block":
        # each pair module reruns in its own backward: a segment's rerun keeps only the module
        # inputs, and the inputs of the modules not yet differentiated stay until theirs runs
        alive = [0, 1, 2, 3, 4, 4, 4]
        transient = max(k * z + m.backward for k, m in zip(alive, mods, strict=False))
        others = (per - 1) * (block_saved + z)
        kept = segments * (z + s) + others + block_saved - 4 * z
        return size * (kept + z + s + z + transient + grads)
    if plan.recompute == "none":
        kept = d.n_blocks * block_saved
    else:  # "selective": the segment inputs and every block's kept matmul and attention
        # outputs (counted as all the block saves: errs high), then in a segment's backward
        # the rest of its other blocks' activations again
        kept = segments * (z + s) + (d.n_blocks + per - 1) * block_saved
    transient = max(m.backward for m in mods)
    activations = kept + z + s + 2 * z + transient  # output, its grad, d(z)
    return size * (activations + grads)


def resident_bytes(
    tokens: int, *, dtype: torch.dtype = torch.float32, dims: Dims | None = None
) -> int:
    """Bytes held before the run starts: the weights and the inputs s, z and the pair mask."""
    d = dims or Dims()
    d.check()
    size = torch.empty((), dtype=dtype).element_size()
    n = tokens
    inputs = d.batch * (n * n * d.c_z + n * d.c_s + n * n)
    return size * (parameter_count(d) + inputs)


def _check_tokens(tokens: int) -> None:
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be a positive int, got {tokens!r}")


def _candidates(n: int) -> list[int | None]:
    """Chunk sizes tried, largest first: whole, then powers of two below N down to 1."""
    sizes: list[int | None] = [None]
    c = 1
    while c < n:
        c *= 2
    c //= 2
    while c >= 1:
        sizes.append(c)
        c //= 2
    return sizes


def plan(
    tokens: int,
    budget: int | float | str,
    *,
    training: bool = False,
    c_z: int = 128,
    c_s: int = 384,
    n_heads: int = 16,
    pair_heads: int = 4,
    c_hidden_mul: int = 128,
    c_hidden_pair_att: int = 32,
    transition_n: int = 4,
    n_blocks: int = 1,
    batch: int = 1,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> MemoryPlan:
    """The plan with the largest chunk sizes (and, training, the least recompute) that fits.

    ``budget``: bytes, ``"16GiB"`` or a fraction of free memory on ``device`` (see
    :func:`sci_protenix.parse_budget`); it must hold the weights, the inputs and the predicted
    peak. Chunk sizes are whole or powers of two; each step halves the chunk of the module kind
    whose step lowers the prediction most. In training "block" recompute (chunks rerun in
    backward, blocks as segments of one) is chosen when no chunking alone fits; in inference,
    in-place accumulation (``inplace=True``: the caller's z is overwritten) likewise. Raises
    ValueError naming the smallest budget that would do when even chunks of 1 with recompute do
    not fit.
    """
    limit = parse_budget(budget, device=device)
    dims = Dims(
        c_z=c_z,
        c_s=c_s,
        n_heads=n_heads,
        pair_heads=pair_heads,
        c_hidden_mul=c_hidden_mul,
        c_hidden_pair_att=c_hidden_pair_att,
        transition_n=transition_n,
        n_blocks=n_blocks,
        batch=batch,
    )
    dims.check()
    _check_tokens(tokens)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    room = limit - resident_bytes(tokens, dtype=dtype, dims=dims)
    policies = (
        (("none", False), ("block", False)) if training else (("none", False), ("none", True))
    )
    best: MemoryPlan | None = None
    for policy, inplace in policies:
        candidate = _shrink(tokens, room, policy, inplace, training, dtype, dims)
        if _peak(tokens, candidate, training, dtype, dims) <= room:
            return candidate
        best = candidate
    assert best is not None
    needed = resident_bytes(tokens, dtype=dtype, dims=dims) + _peak(
        tokens, best, training, dtype, dims
    )
    mode = "training (block recompute)" if training else "inference"
    raise ValueError(
        f"{tokens} tokens do not fit in {format_bytes(limit)}: {mode} with its smallest chunks "
        f"needs about {format_bytes(needed)} (weights and inputs {format_bytes(limit - room)}); "
        f"give a budget of at least {format_bytes(needed, up=True)}, or fewer tokens"
    )


def _peak(tokens: int, p: MemoryPlan, training: bool, dtype: torch.dtype, dims: Dims) -> int:
    return predict_peak(tokens, p, training=training, dtype=dtype, dims=dims)


def _shrink(
    tokens: int,
    room: int,
    policy: str,
    inplace: bool,
    training: bool,
    dtype: torch.dtype,
    dims: Dims,
) -> MemoryPlan:
    """Halve chunk sizes, the most helpful kind first, until the prediction fits in ``room``
    (or nothing shrinks further); then double each kind's again while the prediction still
    fits (a step that did not lower the peak alone, or a kind halved before the one that set
    the peak, may have halved it more than needed)."""
    sizes = _candidates(tokens)
    at = dict.fromkeys(KINDS, 0)  # index into sizes per kind

    def make(index: dict[PairKind, int]) -> MemoryPlan:
        chunks = {k: sizes[i] for k, i in index.items()}
        return MemoryPlan(**chunks, recompute=policy, inplace=inplace)  # type: ignore[arg-type]

    current = make(at)
    peak = _peak(tokens, current, training, dtype, dims)
    while peak > room:
        options = []
        for kind in KINDS:
            if at[kind] + 1 < len(sizes):
                trial = {**at, kind: at[kind] + 1}
                options.append((_peak(tokens, make(trial), training, dtype, dims), kind, trial))
        if not options:
            break
        best_peak, _, best_at = min(options, key=lambda o: (o[0], KINDS.index(o[1])))
        if best_peak >= peak:  # no single step helps: step every kind that can
            best_at = {k: min(i + 1, len(sizes) - 1) for k, i in at.items()}
            best_peak = _peak(tokens, make(best_at), training, dtype, dims)
            if best_at == at:
                break
        at, peak = best_at, best_peak
        current = make(at)
    if peak > room:
        return current
    grown = True  # then grow back each kind a step halved more than the fit needs
    while grown:
        grown = False
        for kind in KINDS:
            if at[kind] > 0:
                trial = {**at, kind: at[kind] - 1}
                if _peak(tokens, make(trial), training, dtype, dims) <= room:
                    at, grown = trial, True
    return make(at)
