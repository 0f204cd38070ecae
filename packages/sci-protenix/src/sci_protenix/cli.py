"""``spore sci-protenix``: memory planning for Pairformer stacks."""

from __future__ import annotations

import click


@click.group("sci-protenix")
def group() -> None:
    """Pairformer memory and speed (sci-protenix)."""
