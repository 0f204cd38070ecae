"""Graph passes for users: register one, turn the registered passes on, run them by hand.

Registering a pass (``spore.register_custom_pass``, or a plugin's ``spore_register_passes``)
runs nothing by itself. The registered passes of every loaded plugin run:

- in ``torch.compile(model, backend="spore")``: Inductor with the passes installed for that
  compile only (dynamo finds the backend through the ``torch_dynamo_backends`` entry point of
  spore-core, so nothing needs importing first); ``mode=`` and ``options=`` are Inductor's;
- in every Inductor compile of the process after :func:`enable` (idempotent), for users who
  keep the default ``inductor`` backend.

A plain ``torch.compile`` runs no Spore pass unless one of the two is used. This module is the
host side: it loads the plugins through :mod:`spore.plugins` and hands their pass registry to
the mechanism, :mod:`spore.graph_passes`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from spore import graph_passes
from spore.graph_passes import (
    STAGES,
    GraphPass,
    PassEntry,
    PatternToPatternPass,
    SearchForm,
    stats,
    totals,
)

if TYPE_CHECKING:
    from spore.registry import PassRegistry


def _registry() -> PassRegistry:
    """The process-wide pass registry (the first use loads the plugins)."""
    from spore.plugins import get_manager

    return get_manager().registry("passes")  # type: ignore[return-value]


def register_custom_pass(
    pass_: Any,
    *,
    name: str | None = None,
    stage: str = "post_grad",
    backend: str = "inductor",
    device: str | None = None,
    priority: int = 0,
    override: bool = False,
) -> PassEntry:
    """Register a pass (owner: ``user``); it runs where the registered passes run (see above)."""
    if backend != "inductor":
        raise ValueError(
            f"backend {backend!r} is not supported for custom passes; only 'inductor' (the "
            f"MindSpore frontend forwards .so passes separately)"
        )
    return _registry().add(
        pass_, name=name, stage=stage, priority=priority, device=device, override=override
    )


def enable() -> None:
    """Run the registered passes in every later Inductor compile of this process (idempotent).

    Loads the plugins and installs one multiplexer per Inductor slot, chaining what the slot
    holds; passes registered later run too.
    """
    graph_passes.install(_registry())


def inductor_backend(
    gm: Any,
    example_inputs: Any,
    *,
    mode: str | None = None,
    options: Mapping[str, Any] | None = None,
) -> Any:
    """``torch.compile(..., backend="spore")``: Inductor with the registered passes installed.

    ``mode`` and ``options`` are those given to ``torch.compile``; an unknown option is a
    ``ValueError`` naming it.
    """
    return graph_passes.compile_fx(gm, example_inputs, _registry(), mode=mode, options=options)


def apply(gm: Any, stage: str = "post_grad") -> dict[str, int]:
    """Run the registered passes for ``stage`` on any FX GraphModule (no compile)."""
    return graph_passes.apply(gm, _registry(), stage)


__all__ = [
    "STAGES",
    "GraphPass",
    "PassEntry",
    "PatternToPatternPass",
    "SearchForm",
    "apply",
    "enable",
    "inductor_backend",
    "register_custom_pass",
    "stats",
    "totals",
]
