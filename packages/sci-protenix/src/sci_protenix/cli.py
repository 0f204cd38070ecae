"""``spore sci-protenix``: memory planning for Pairformer stacks."""

from __future__ import annotations

from typing import Any

import click

KIND_NAMES = {
    "tri_mul": "triangle multiplication",
    "tri_att": "triangle attention",
    "transition": "transitions",
    "pair_bias": "attention with pair bias",
}
DTYPES = ("float32", "bfloat16", "float16")


@click.group("sci-protenix")
def group() -> None:
    """Pairformer memory and speed (sci-protenix)."""


@group.command("plan")
@click.option("--tokens", "-n", type=int, required=True, help="Sequence length N (tokens).")
@click.option(
    "--budget",
    required=True,
    help="Memory for the run: '16GiB', '512MiB', bytes, or a fraction of free memory ('0.5').",
)
@click.option("--training", is_flag=True, help="Plan forward + backward (else inference).")
@click.option("--blocks", "n_blocks", type=int, default=1, show_default=True, help="Blocks.")
@click.option("--batch", type=int, default=1, show_default=True, help="Sequences per batch.")
@click.option("--c-z", type=int, default=128, show_default=True, help="Pair channels.")
@click.option("--c-s", type=int, default=384, show_default=True, help="Single channels (0: none).")
@click.option("--n-heads", type=int, default=16, show_default=True, help="Pair-bias heads.")
@click.option("--pair-heads", type=int, default=4, show_default=True, help="Triangle heads.")
@click.option("--c-hidden-mul", type=int, default=128, show_default=True)
@click.option("--c-hidden-pair-att", type=int, default=32, show_default=True)
@click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True)
@click.option("--device", default="cpu", show_default=True, help="Whose free memory a fraction is.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def plan_command(
    tokens: int,
    budget: str,
    training: bool,
    n_blocks: int,
    batch: int,
    c_z: int,
    c_s: int,
    n_heads: int,
    pair_heads: int,
    c_hidden_mul: int,
    c_hidden_pair_att: int,
    dtype: str,
    device: str,
    as_json: bool,
) -> None:
    """The chunk sizes and recompute a Pairformer of N tokens would use within BUDGET, and its
    predicted peak memory."""
    import torch

    from sci_protenix.budget import format_bytes, parse_budget
    from sci_protenix.planning import Dims, plan, predict_peak, resident_bytes

    widths = {
        "c_z": c_z,
        "c_s": c_s,
        "n_heads": n_heads,
        "pair_heads": pair_heads,
        "c_hidden_mul": c_hidden_mul,
        "c_hidden_pair_att": c_hidden_pair_att,
        "n_blocks": n_blocks,
        "batch": batch,
    }
    torch_dtype = getattr(torch, dtype)
    try:
        limit = parse_budget(budget, device=device)
        chosen = plan(tokens, limit, training=training, dtype=torch_dtype, **widths)
    except (ValueError, TypeError, RuntimeError) as exc:
        line = str(exc).strip().splitlines()[0]  # torch's errors: not their C++ frames
        if "Overflow" in line:
            line = f"these sizes are too large to plan (a tensor of over 2**63 elements): {line}"
        raise click.ClickException(line) from None
    dims = Dims(**widths)
    peak = predict_peak(tokens, chosen, training=training, dtype=torch_dtype, dims=dims)
    resident = resident_bytes(tokens, dtype=torch_dtype, dims=dims)
    report: dict[str, Any] = {
        "tokens": tokens,
        "mode": "training" if training else "inference",
        "budget_bytes": limit,
        "plan": chosen.model_dump(mode="json"),
        "predicted_peak_bytes": peak,
        "resident_bytes": resident,
        "total_bytes": peak + resident,
    }
    if as_json:
        from spore.cli.render import echo_json

        echo_json(report)
        return
    from spore.cli.render import Column, print_table

    rows = [
        {
            "what": KIND_NAMES[k],
            "value": "none (--c-s 0)"
            if k == "pair_bias" and not c_s
            else _chunk(getattr(chosen, k), tokens),
        }
        for k in KIND_NAMES
    ]
    rows += [
        {"what": "recompute", "value": chosen.recompute if training else "none (inference)"},
        {"what": "in-place", "value": "yes (z overwritten)" if chosen.inplace else "no"},
        {"what": "predicted peak", "value": format_bytes(peak)},
        {"what": "weights + inputs", "value": format_bytes(resident)},
        {
            "what": "total / budget",
            "value": f"{format_bytes(peak + resident)} / {format_bytes(limit)}",
        },
    ]
    print_table(
        f"sci-protenix plan: {tokens} tokens, {report['mode']}, {n_blocks} block(s), {dtype}",
        [
            Column("", lambda r: r["what"], "name"),
            Column("chunk size / figure", lambda r: r["value"]),
        ],
        rows,
    )


def _chunk(size: int | None, tokens: int) -> str:
    return "whole" if size is None or size >= tokens else f"{size} rows"
