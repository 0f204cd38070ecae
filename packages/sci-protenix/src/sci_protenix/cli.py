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


POSITIVE = click.IntRange(min=1)


class PlanCommand(click.Command):
    """A command whose missing option, given as a bare value instead, is named with the fix."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        given = list(args)
        try:
            return super().parse_args(ctx, args)
        except click.MissingParameter as missing:
            _, stray, _ = self.make_parser(ctx).parse_args(given)
            if not stray or not isinstance(missing.param, click.Option):
                raise
            option = missing.param.opts[0]
            try:  # suggested only where it would be taken
                missing.param.type.convert(stray[0], missing.param, ctx)
                hint = f": did you mean {option} {stray[0]}?"
            except click.BadParameter:
                hint = ""
            raise click.UsageError(
                f"Missing option '{option}', and {stray[0]!r} is an argument this command does "
                f"not take (it takes options only){hint}",
                ctx,
            ) from None


def _device(ctx: click.Context, param: click.Parameter, value: str) -> str:
    import torch

    if value.partition(":")[0] == "npu":  # torch knows it once torch_npu is imported
        return value
    try:
        torch.device(value)
    except RuntimeError:
        raise click.BadParameter(
            f"{value!r} is not a torch device; give one such as 'cpu', 'cuda' or 'cuda:1'"
        ) from None
    return value


@group.command("plan", cls=PlanCommand)
@click.option("--tokens", "-n", type=POSITIVE, required=True, help="Sequence length N (tokens).")
@click.option(
    "--budget",
    required=True,
    help="Memory for the run: '16GiB', '512MiB', bytes, or a fraction of free memory ('0.5').",
)
@click.option("--training", is_flag=True, help="Plan forward + backward (else inference).")
@click.option("--blocks", "n_blocks", type=POSITIVE, default=1, show_default=True, help="Blocks.")
@click.option("--batch", type=POSITIVE, default=1, show_default=True, help="Sequences per batch.")
@click.option("--c-z", type=POSITIVE, default=128, show_default=True, help="Pair channels.")
@click.option(
    "--c-s",
    type=click.IntRange(min=0),
    default=384,
    show_default=True,
    help="Single channels (0: none), a multiple of --n-heads.",
)
@click.option("--n-heads", type=POSITIVE, default=16, show_default=True, help="Pair-bias heads.")
@click.option("--pair-heads", type=POSITIVE, default=4, show_default=True, help="Triangle heads.")
@click.option("--c-hidden-mul", type=POSITIVE, default=128, show_default=True)
@click.option("--c-hidden-pair-att", type=POSITIVE, default=32, show_default=True)
@click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True)
@click.option(
    "--device",
    default="cpu",
    show_default=True,
    callback=_device,
    help="Whose free memory a fraction is.",
)
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
    """The chunk sizes and recompute a Pairformer of --tokens tokens would use within --budget,
    and its predicted peak memory."""
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
    if c_s % n_heads:
        raise click.BadParameter(
            f"{c_s} is not a multiple of --n-heads ({n_heads})", param_hint="'--c-s'"
        )
    torch_dtype = getattr(torch, dtype)
    try:
        limit = parse_budget(budget, device=device)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise click.BadParameter(str(exc), param_hint="'--budget'") from None
    try:
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
