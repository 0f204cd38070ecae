"""The hook lite-boost publishes for other Spore plugins (added through ``spore_addhooks``).

A package with boosters for its own model classes implements it in its Spore plugin module;
lite-boost may be absent, so mark the implementation optional::

    @spore.hookimpl(optionalhook=True)
    def lite_boost_register_boosters(registry):
        registry.add("MyVideoTransformer", boost_my_transformer)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from lite_boost.boosters import BoosterRegistry

hookspec = pluggy.HookspecMarker("spore")


@hookspec
def lite_boost_register_boosters(registry: BoosterRegistry) -> None:
    """Add boosters: ``registry.add(class_name, booster)``, matched by the model's class name.

    A booster is called as ``booster(model, options)`` and patches ``model`` in place; see
    :func:`lite_boost.boost`. Called once per plugin manager, at the first :func:`boost`.

    .. versionadded:: 0.1.0
    """
