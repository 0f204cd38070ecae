"""``spore bench sci-protenix``: a PairformerBlock's training memory and time against naive.

Every case trains one ``PairformerBlock(c_z=128, c_s=384)`` step (forward, then backward of the
summed outputs) on random weights (seeded; Protenix's zero-initialised output projections would
make every update zero) and random inputs with a pair mask that pads the last tokens. The
baseline, *naive*, is the block as plain PyTorch runs it from the AF3 algorithms: no chunking,
no recompute, and triangle attention and attention with pair bias as the unfused composite
(einsum, + bias, mask, softmax, einsum under autograd, so the [N, H, N, N] probabilities are
kept for backward). Each sample reports ``seconds``, ``peak_mib`` (``spore.memory.peak``: the
tensors the step creates, parameter gradients included), ``memory_ratio`` (peak / naive's
peak; 1 on the baseline) and ``max_rel_diff`` (largest difference of the outputs and parameter
gradients from naive's, relative to each tensor's magnitude: :func:`max_rel_diff`; 0 on the
baseline).

- ``train-<N>-chunked``: the block with every module chunked (``CHUNK`` rows), no recompute;
- ``train-<N>-recompute``: the same chunks, each rerun in backward (``recompute="block"``);
- ``max-tokens``: the largest N (a multiple of ``STEP``) whose training step fits in
  ``BUDGET`` (``SCI_PROTENIX_BENCH_BUDGET``, default 1 GiB; weights and inputs included):
  naive, found by measuring, against the plan of :func:`sci_protenix.plan` at the largest N
  it accepts, then measured; extra ``tokens``;
- ``tri-att-<N>``: one TriangleAttention module's training step, the fused
  ``torch.ops.spore.triangle_attention`` against the unfused composite.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch

from spore.bench import Benchmark

C_Z, C_S = 128, 384
TOKENS = (128, 256, 384)
CHUNK = 32
BUDGET = os.environ.get("SCI_PROTENIX_BENCH_BUDGET", "1GiB")
STEP = 16
PADDED = 1 / 16  # the share of tokens the pair mask pads
TOLERANCE = 2e-3  # fp32, relative to the largest magnitude of each compared tensor
MIB = 2**20

Outputs = tuple[torch.Tensor, ...]


def widths() -> dict[str, int]:
    """The block's widths: C_Z, C_S and Protenix's 16 heads of 24 channels at c_s = 384."""
    return {"c_z": C_Z, "c_s": C_S, "n_heads": max(1, C_S // 24)}


def make_block(n: int, seed: int = 0) -> tuple[Any, ...]:
    """A PairformerBlock with seeded random weights (no dropout) and its inputs s, z, mask."""
    from sci_protenix.pairformer import PairformerBlock

    g = torch.Generator().manual_seed(seed)
    block = PairformerBlock(**widths(), dropout=0.0)
    c_z, c_s = C_Z, C_S
    with torch.no_grad():
        for name, param in block.named_parameters():
            noise = torch.randn(param.shape, generator=g)
            if param.dim() >= 2:
                param.copy_(noise / param.shape[-1] ** 0.5)
            else:
                param.copy_(1.0 + 0.1 * noise if name.endswith("weight") else 0.1 * noise)
    s = torch.randn(n, c_s, generator=g)
    z = torch.randn(n, n, c_z, generator=g)
    real = torch.arange(n) < n - int(n * PADDED)
    mask = (real[:, None] & real[None, :]).float()
    return block, s, z, mask


def _triangle_attention_naive(module: Any, z: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    from spore_kernels.ops.triangle_attention import composite

    if not module.starting:
        z, mask = z.transpose(-2, -3), mask.transpose(-1, -2)
    zn = module.layer_norm(z)
    bias = module.linear(zn).movedim(-1, -3)
    q, k, v = module.mha.qkv(zn, zn)
    out = module.mha.wrap_up(composite(q, k, v, bias, mask.bool()), zn)
    return out if module.starting else out.transpose(-2, -3)


def _pair_bias_naive(module: Any, a: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    from spore_kernels.ops.triangle_attention import composite

    an = module.layernorm_a(a)
    q, k, v = (t.unsqueeze(-4) for t in module.attention.qkv(an, an))
    bias = module.linear_nobias_z(module.layernorm_z(z)).movedim(-1, -3)
    return module.attention.wrap_up(composite(q, k, v, bias, None).squeeze(-4), an)


def naive_block(block: Any, s: torch.Tensor, z: torch.Tensor, mask: torch.Tensor) -> Outputs:
    """The block's update as plain PyTorch from AF3 algorithm 17 (same parameters): whole
    modules, unfused attention."""
    if block.plan is not None:
        raise ValueError("naive_block runs the block whole: clear its plan first")
    z = z + block.tri_mul_out(z, mask)
    z = z + block.tri_mul_in(z, mask)
    z = z + _triangle_attention_naive(block.tri_att_start, z, mask)
    z = z + _triangle_attention_naive(block.tri_att_end, z, mask)
    z = z + block.pair_transition(z)
    s = s + _pair_bias_naive(block.attention_pair_bias, s, z)
    s = s + block.single_transition(s)
    return s, z


def train_step(block: Any, run: Callable[[], Outputs]) -> tuple[dict[str, float], Outputs]:
    """One forward + backward of ``run()``'s summed outputs: its figures and what it made (the
    outputs, then the parameter gradients)."""
    from spore import memory

    block.zero_grad(set_to_none=True)
    start = time.perf_counter()
    with memory.peak() as meter:
        outs = run()
        sum(o.sum() for o in outs).backward()
    seconds = time.perf_counter() - start
    made = tuple(o.detach() for o in outs) + tuple(
        p.grad for p in block.parameters() if p.grad is not None
    )
    return {"seconds": seconds, "peak_mib": meter.peak_bytes / MIB}, made


def max_rel_diff(a: Outputs, b: Outputs) -> float:
    """The largest ``|a - b|`` of any tensor, relative to that tensor's largest ``|a|`` (floored
    at ``1e-4`` of the largest ``|a|`` of all, so a tensor that is zero up to rounding, such as a
    bias gradient that softmax cancels, is not divided by almost nothing)."""
    scales = [float(x.abs().max()) for x in a]
    floor = 1e-4 * max(scales)
    return max(
        float((x - y).abs().max()) / max(scale, floor)
        for x, y, scale in zip(a, b, scales, strict=True)
    )


def _agree(base: dict[str, float], cand: dict[str, float]) -> None:
    if not cand["max_rel_diff"] <= TOLERANCE:
        raise AssertionError(
            f"outputs differ from naive's by {cand['max_rel_diff']:.2e} (relative), more than "
            f"{TOLERANCE:.0e}"
        )


def _block_case(n: int, recompute: bool) -> Benchmark:
    from sci_protenix.chunking import apply_plan
    from sci_protenix.memory_plan import MemoryPlan

    chosen = MemoryPlan(
        tri_mul=CHUNK,
        tri_att=CHUNK,
        transition=CHUNK,
        pair_bias=CHUNK,
        recompute="block" if recompute else "none",
    )

    def setup() -> dict[str, Any]:
        block, s, z, mask = make_block(n)
        return {"block": block, "inputs": (s, z, mask), "naive": None}

    def baseline(state: dict[str, Any]) -> dict[str, float]:
        block = apply_plan(state["block"], None)
        figures, made = train_step(block, lambda: naive_block(block, *state["inputs"]))
        state["naive"] = made  # the reference for the candidate's outputs
        state["naive_peak"] = figures["peak_mib"]
        return {**figures, "memory_ratio": 1.0, "max_rel_diff": 0.0}

    def candidate(state: dict[str, Any]) -> dict[str, float]:
        block = apply_plan(state["block"], chosen)
        try:
            figures, made = train_step(block, lambda: block(*state["inputs"]))
        finally:
            apply_plan(block, None)
        if state["naive"] is None:  # the runner alternates: the first sample is the baseline's
            raise RuntimeError("the candidate ran before the naive baseline")
        return {
            **figures,
            "memory_ratio": figures["peak_mib"] / state["naive_peak"],
            "max_rel_diff": max_rel_diff(state["naive"], made),
        }

    what = f"chunks of {CHUNK} rows" + (", each recomputed in backward" if recompute else "")
    return Benchmark(
        name=f"train-{n}-{'recompute' if recompute else 'chunked'}",
        baseline=baseline,
        candidate=candidate,
        baseline_label=f"naive PairformerBlock training step, N={n} (whole modules, unfused "
        f"attention)",
        candidate_label=f"sci_protenix PairformerBlock, {what}",
        setup=setup,
        check=_agree,
        description="peak memory (peak_mib, memory_ratio) and time of one training step",
        self_timed=True,
    )


def _fits(n: int, run: Callable[[Any, tuple[torch.Tensor, ...]], Outputs], limit: int) -> dict:
    """Train ``run`` once at ``n`` tokens: its figures and whether weights + inputs + peak fit."""
    from sci_protenix.planning import Dims, resident_bytes

    block, s, z, mask = make_block(n)
    figures, _ = train_step(block, lambda: run(block, (s, z, mask)))
    total = resident_bytes(n, dims=Dims(**widths())) + figures["peak_mib"] * MIB
    return {**figures, "tokens": float(n), "fits": float(total <= limit)}


def largest_naive(limit: int) -> dict[str, float]:
    """The largest multiple of STEP tokens whose naive training step fits ``limit`` (measured:
    up in steps of 4 * STEP, then down in steps of STEP)."""

    def naive(block: Any, inputs: tuple[torch.Tensor, ...]) -> Outputs:
        return naive_block(block, *inputs)

    best: dict[str, float] | None = None
    n = 4 * STEP
    while True:
        trial = _fits(n, naive, limit)
        if not trial["fits"]:
            break
        best, n = trial, n + 4 * STEP
    n -= STEP
    while best is None or n > best["tokens"]:
        trial = _fits(n, naive, limit)
        if trial["fits"]:
            return trial
        n -= STEP
        if n < STEP:
            raise RuntimeError(f"no naive training step fits in {limit} bytes")
    return best


def largest_planned(limit: int, start: int) -> dict[str, float]:
    """The largest multiple of STEP tokens the planner accepts for ``limit``, measured (one step
    down while the measurement does not fit)."""
    from sci_protenix.chunking import apply_plan
    from sci_protenix.planning import plan

    def accepted(n: int) -> bool:
        try:
            plan(n, limit, training=True, **widths())
        except ValueError:
            return False
        return True

    n = start
    while accepted(n + STEP):
        n += STEP
    while n >= STEP:
        chosen = plan(n, limit, training=True, **widths())

        def planned(block: Any, inputs: tuple[torch.Tensor, ...], p: Any = chosen) -> Outputs:
            return apply_plan(block, p)(*inputs)

        trial = _fits(n, planned, limit)
        if trial["fits"]:
            return trial
        n -= STEP
    raise RuntimeError(f"no planned training step fits in {limit} bytes")


def _max_tokens_case() -> Benchmark:
    from sci_protenix.budget import parse_budget

    limit = parse_budget(BUDGET)

    def setup() -> dict[str, Any]:
        return {}

    def baseline(state: dict[str, Any]) -> dict[str, float]:
        found = largest_naive(limit)
        state["naive_tokens"] = int(found["tokens"])
        return {key: found[key] for key in ("seconds", "peak_mib", "tokens")}

    def candidate(state: dict[str, Any]) -> dict[str, float]:
        found = largest_planned(limit, state.get("naive_tokens", STEP))
        return {key: found[key] for key in ("seconds", "peak_mib", "tokens")}

    return Benchmark(
        name="max-tokens",
        baseline=baseline,
        candidate=candidate,
        baseline_label=f"naive PairformerBlock: largest N training within {BUDGET}",
        candidate_label=f"sci_protenix.plan(N, {BUDGET!r}, training=True)",
        setup=setup,
        description="tokens: the largest N that trains within the budget (seconds: its step)",
        self_timed=True,
    )


def _triangle_attention_case(n: int) -> Benchmark:
    from sci_protenix.triangle import TriangleAttention

    def setup() -> dict[str, Any]:
        block, _, z, mask = make_block(n)
        module: TriangleAttention = block.tri_att_start
        return {"module": module, "z": z.requires_grad_(), "mask": mask, "naive": None}

    def step(state: dict[str, Any], run: Callable[[], torch.Tensor]) -> tuple[dict, Outputs]:
        state["z"].grad = None
        figures, made = train_step(state["module"], lambda: (run(),))
        return figures, (*made, state["z"].grad)

    def baseline(state: dict[str, Any]) -> dict[str, float]:
        module, z, mask = state["module"], state["z"], state["mask"]
        figures, state["naive"] = step(state, lambda: _triangle_attention_naive(module, z, mask))
        state["naive_peak"] = figures["peak_mib"]
        return {**figures, "memory_ratio": 1.0, "max_rel_diff": 0.0}

    def candidate(state: dict[str, Any]) -> dict[str, float]:
        module, z, mask = state["module"], state["z"], state["mask"]
        figures, made = step(state, lambda: module(z, mask))
        return {
            **figures,
            "memory_ratio": figures["peak_mib"] / state["naive_peak"],
            "max_rel_diff": max_rel_diff(state["naive"], made),
        }

    return Benchmark(
        name=f"tri-att-{n}",
        baseline=baseline,
        candidate=candidate,
        baseline_label=f"TriangleAttention training step, N={n}, unfused composite attention",
        candidate_label="sci_protenix TriangleAttention (torch.ops.spore.triangle_attention)",
        setup=setup,
        check=_agree,
        description="the fused triangle attention op inside its module, forward + backward",
        self_timed=True,
    )


def benchmarks() -> list[Benchmark]:
    """Every sci-protenix benchmark case."""
    cases = [_block_case(n, recompute) for n in TOKENS for recompute in (False, True)]
    return [*cases, _max_tokens_case(), _triangle_attention_case(128)]
