"""``spore lite-boost``: what lite-boost knows and what a boost would change."""

from __future__ import annotations

import click


@click.group("lite-boost")
def group() -> None:
    """Video-diffusion inference acceleration (lite-boost)."""


@group.command("explain")
@click.argument("model_class")
def explain(model_class: str) -> None:
    """What `lite_boost.boost` changes in a model of class MODEL_CLASS."""
    from lite_boost.boosters import find

    try:
        booster = find(model_class)
    except LookupError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{model_class}: booster from {booster.owner}")
    for change in booster.changes:
        click.echo(f"  - {change}")


@group.command("boosters")
def list_boosters() -> None:
    """The model classes lite-boost can boost."""
    from lite_boost.boosters import boosters

    for name, booster in sorted(boosters().items()):
        click.echo(f"{name}  ({booster.owner})")
