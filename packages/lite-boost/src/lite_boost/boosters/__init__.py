"""Boosters: per-model-class patches that switch a model to lite-boost's attention, RoPE and
parallel paths in place.

A booster is registered for a class name (``@register_booster("WanTransformer3DModel")`` in
Python, or the ``lite_boost_register_boosters`` hook from another plugin) and found by the
model's class name or the name of one of its base classes. :func:`boost` applies it.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import torch
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt

from lite_boost.numeric_args import as_int, as_written, is_number

HOOK = "lite_boost_register_boosters"
log = logging.getLogger("lite_boost")


def _integer(value: Any) -> Any:
    """``value`` as an int when it is an integer of another type (numpy's, a 0-d tensor's), else
    as it is (a bool or a float then fails ``StrictInt``)."""
    n = as_int(value)
    return value if n is None else n


def _real(value: Any) -> Any:
    """``value`` when it is a real number (numpy's too, a float16 or float32 as written:
    :func:`lite_boost.numeric_args.as_written`), not a bool, a string or a tensor (which
    pydantic would convert)."""
    if not is_number(value):
        raise ValueError(f"must be a number, got {type(value).__name__} {value!r}")
    return as_written(value)


class BoostOptions(BaseModel):
    """What :func:`boost` was asked for."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    sparsity: Annotated[float, BeforeValidator(_real)] = Field(
        0.0, ge=0.0, lt=1.0, description="share of KV blocks skipped (a number)"
    )
    block_size: Annotated[StrictInt, BeforeValidator(_integer)] = Field(
        128, gt=0, description="tokens per attention block (an int; numpy ints taken)"
    )
    parallel: Any = Field(None, description="a lite_boost.ParallelManager, or None")


@dataclass(frozen=True)
class Booster:
    """``apply(model, options)`` patches a model of class ``class_name`` in place; ``changes``
    says what it changes, for ``spore lite-boost explain``."""

    class_name: str
    apply: Callable[[torch.nn.Module, BoostOptions], None]
    changes: tuple[str, ...]
    owner: str = "python"
    override: bool = False


class BoosterRegistry:
    """What ``lite_boost_register_boosters`` receives: ``registry.add(class_name, apply,
    changes)``."""

    def __init__(self, owner: str = "python") -> None:
        self.owner = owner
        self.boosters: dict[str, Booster] = {}

    def add(
        self,
        class_name: str,
        apply: Callable[[torch.nn.Module, BoostOptions], None],
        changes: tuple[str, ...] | list[str] = (),
        *,
        override: bool = False,
        _owner: str | None = None,
    ) -> Booster:
        """Register ``apply`` for ``class_name``; ``override`` replaces a booster already
        registered for it here (else that is a ``ValueError``), and from a plugin's hook,
        lite-boost's own booster for that class (else the plugin's is skipped with a
        warning)."""
        if not isinstance(class_name, str):
            raise TypeError(f"class_name must be a class's name (a str), got {class_name!r}")
        if not class_name.isidentifier():
            raise ValueError(f"class_name must be a class name, got {class_name!r}")
        if not callable(apply):
            raise TypeError(
                f"a booster must be callable as apply(model, options), got "
                f"{type(apply).__name__} {apply!r} for {class_name}"
            )
        if isinstance(changes, str):
            raise TypeError(f"changes is a list of str, one per change: give [{changes!r}]")
        given, changes = changes, tuple(changes)  # once: an iterator is read here
        if not all(isinstance(c, str) for c in changes):
            raise TypeError(f"changes must be a list of str, got {given!r}")
        if class_name in self.boosters and not override:
            raise ValueError(
                f"a booster for {class_name} is already registered; pass override=True to "
                "replace it"
            )
        booster = Booster(class_name, apply, changes, _owner or self.owner, override)
        self.boosters[class_name] = booster
        return booster


_lock = threading.RLock()
_python = BoosterRegistry()  # lite-boost's own (owner "lite-boost") and the user's
_OWN = "lite-boost"
_own_classes: set[str] = set()  # the classes lite-boost's own boosters are for
_shadowed: set[tuple[str, str]] = set()  # (class, plugin) a user's booster replaced, logged
_from_plugins: weakref.WeakKeyDictionary[Any, dict[str, Booster]] = weakref.WeakKeyDictionary()


def register_booster(
    class_name: str, *, changes: tuple[str, ...] | list[str] = (), override: bool = False
) -> Callable[[Callable[[torch.nn.Module, BoostOptions], None]], Any]:
    """Decorator: ``fn(model, options)`` boosts models of class ``class_name``; ``override``
    replaces a booster registered for it before in Python (lite-boost's own included; else a
    ``ValueError``). It takes precedence over a plugin's booster for the class, which is
    logged unless ``override`` says so."""
    return _registering(class_name, changes, override, "python")


def _registering(
    class_name: str, changes: tuple[str, ...] | list[str], override: bool, owner: str
) -> Callable[[Callable[[torch.nn.Module, BoostOptions], None]], Any]:
    """:func:`register_booster` with the owner the listings name (lite-boost's own:
    ``lite-boost``)."""

    def decorate(fn: Callable[[torch.nn.Module, BoostOptions], None]) -> Any:
        _load_builtin()  # first: a clash with one of ours is found here, not at a later find()
        with _lock:
            _python.add(class_name, fn, changes, override=override, _owner=owner)
        return fn

    return decorate


def _builtin_booster(
    class_name: str, *, changes: tuple[str, ...]
) -> Callable[[Callable[[torch.nn.Module, BoostOptions], None]], Any]:
    """:func:`register_booster` for lite-boost's own boosters (``BUILTIN``)."""
    _own_classes.add(class_name)
    return _registering(class_name, changes, False, _OWN)


def _plugin_boosters() -> dict[str, Booster]:
    from spore.plugins import get_manager

    manager = get_manager()
    with _lock:
        if manager not in _from_plugins:
            found: dict[str, Booster] = {}
            calls = manager.collect(HOOK, BoosterRegistry, skipped="its boosters are skipped")
            for plugin, registry in calls:  # by plugin name
                for name, booster in registry.boosters.items():
                    if name in found:
                        log.warning(
                            "spore plugins %r and %r both register a booster for %s; %r's is "
                            "used (the first by plugin name)",
                            found[name].owner,
                            plugin,
                            name,
                            found[name].owner,
                        )
                    elif name in _own_classes and not booster.override:
                        log.warning(
                            "spore plugin %r registers a booster for %s, which lite-boost "
                            "boosts itself; the plugin's is skipped (registry.add(..., "
                            "override=True) replaces lite-boost's)",
                            plugin,
                            name,
                        )
                    else:
                        found[name] = booster
            _from_plugins[manager] = found
        return _from_plugins[manager]


BUILTIN = ("lite_boost.boosters.wan",)
"""lite-boost's own boosters, imported (and so registered) on first use."""


def _load_builtin() -> None:
    import importlib

    for module in BUILTIN:
        importlib.import_module(module)


def boosters() -> dict[str, Booster]:
    """Every known booster by class name: the user's (:func:`register_booster`) first, then a
    plugin's, then lite-boost's own (which a plugin replaces only with ``override=True``)."""
    _load_builtin()
    with _lock:
        python = dict(_python.boosters)
    table = {name: b for name, b in python.items() if b.owner == _OWN}
    plugins = _plugin_boosters()
    table.update(plugins)
    for name, booster in python.items():
        if booster.owner == _OWN:
            continue
        if name in plugins and not booster.override:
            key = (name, plugins[name].owner)
            if key not in _shadowed:
                _shadowed.add(key)
                log.warning(
                    "the booster registered in Python for %s replaces spore plugin %r's "
                    "(register_booster(..., override=True) says so without this warning)",
                    name,
                    plugins[name].owner,
                )
        table[name] = booster
    return table


def find(model_or_class: torch.nn.Module | type | str) -> Booster:
    """The booster for a model, a class or a class name (its own name first, then its bases');
    ``LookupError`` naming the known classes when there is none."""
    if isinstance(model_or_class, str):
        names = [model_or_class]
    else:
        cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
        names = [c.__name__ for c in cls.__mro__]
    table = boosters()
    for name in names:
        if name in table:
            return table[name]
    known = ", ".join(sorted(table)) or "none"
    wrapped = getattr(model_or_class, "_orig_mod", None)  # torch.compile's OptimizedModule
    if isinstance(model_or_class, torch.nn.Module) and isinstance(wrapped, torch.nn.Module):
        find(wrapped)  # no booster for the model itself: that is the error
        raise LookupError(
            f"no lite-boost booster for {names[0]}: torch.compile wrapped the "
            f"{type(wrapped).__name__}; boost the model before compiling it "
            f"(lite_boost.boost(model), then torch.compile(model))"
        )
    raise LookupError(f"no lite-boost booster for {names[0]} (boosters exist for: {known})")


def boost(
    model: torch.nn.Module,
    *,
    sparsity: float = 0.0,
    block_size: int = 128,
    parallel: Any = None,
) -> torch.nn.Module:
    """Patch ``model`` in place with its class's booster and return it."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"boost() patches a model (a torch.nn.Module such as diffusers' "
            f"WanTransformer3DModel), got {type(model).__name__}"
        )
    options = BoostOptions(sparsity=sparsity, block_size=block_size, parallel=parallel)
    booster = find(model)
    booster.apply(model, options)
    model.lite_boost_options = options
    return model
