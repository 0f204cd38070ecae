"""``spore lite-boost``: what lite-boost knows and what a boost would change."""

from __future__ import annotations

from typing import Any

import click

from spore.cli.render import JSON_OPTION, echo_json


def _row(booster: Any) -> dict[str, Any]:
    return {
        "model_class": booster.class_name,
        "registered_by": booster.owner,
        "changes": list(booster.changes),
    }


@click.group("lite-boost")
def group() -> None:
    """Video-diffusion inference acceleration (lite-boost)."""


@group.command("explain")
@click.argument("model_class")
@JSON_OPTION
def explain(model_class: str, as_json: bool) -> None:
    """What `lite_boost.boost` changes in a model of class MODEL_CLASS."""
    from lite_boost.boosters import find

    try:
        booster = find(model_class)
    except LookupError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        echo_json(_row(booster))
        return
    click.echo(f"{model_class}: booster from {booster.owner}")
    for change in booster.changes:
        click.echo(f"  - {change}")


@group.command("boosters")
@JSON_OPTION
def list_boosters(as_json: bool) -> None:
    """The model classes lite-boost can boost, and who registered each booster."""
    from lite_boost.boosters import boosters

    found = sorted(boosters().items())
    if as_json:
        echo_json([_row(b) for _, b in found])
        return
    for name, booster in found:
        click.echo(f"{name}  ({booster.owner})")
