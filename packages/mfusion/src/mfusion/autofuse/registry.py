"""Which region compilers are active: those registered in Python and those plugins provide.

Plugins provide compilers through the ``mfusion_register_region_compilers`` hook (see
:mod:`mfusion.hookspecs`), called once per Spore plugin manager, at the first compile that
needs them; a plugin whose hook raises is logged and skipped, unless it was asked for by
name (``SPORE_PLUGINS``) or ``SPORE_STRICT_PLUGINS=1`` is set: then it is a ``PluginError``,
as for the core's hooks. Users and tests add compilers with :func:`register_region_compiler`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections.abc import Iterator
from types import TracebackType
from typing import Any

from mfusion.autofuse.protocol import RegionCompiler, check_compiler

HOOK = "mfusion_register_region_compilers"

log = logging.getLogger("mfusion.autofuse")
_lock = threading.RLock()
_registered: list[RegionCompiler] = []
_from_plugins: weakref.WeakKeyDictionary[Any, list[RegionCompiler]] = weakref.WeakKeyDictionary()
_serials: dict[int, tuple[RegionCompiler, int]] = {}
_counter = itertools.count(1)


class RegionCompilerRegistry:
    """What ``mfusion_register_region_compilers`` receives: ``registry.add(compiler)``."""

    def __init__(self) -> None:
        self._compilers: dict[str, RegionCompiler] = {}

    def add(self, compiler: RegionCompiler) -> RegionCompiler:
        """Add ``compiler``; ``TypeError`` if it does not follow the protocol, ``ValueError``
        if its name is taken."""
        check_compiler(compiler)
        if compiler.name in self._compilers:
            raise ValueError(f"a region compiler named {compiler.name!r} is already registered")
        self._compilers[compiler.name] = compiler
        return compiler

    def __iter__(self) -> Iterator[RegionCompiler]:
        return iter(list(self._compilers.values()))

    def __len__(self) -> int:
        return len(self._compilers)


class Registration:
    """A compiler registered by :func:`register_region_compiler`; ``remove()`` or leave the
    ``with`` block to unregister it."""

    def __init__(self, compiler: RegionCompiler) -> None:
        self.compiler = compiler

    def remove(self) -> None:
        """Unregister the compiler (no effect if it is gone already)."""
        with _lock:
            if any(c is self.compiler for c in _registered):
                _registered[:] = [c for c in _registered if c is not self.compiler]

    def __enter__(self) -> RegionCompiler:
        return self.compiler

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.remove()


def register_region_compiler(compiler: RegionCompiler) -> Registration:
    """Make ``compiler`` available to automatic fusion in this process.

    Use the result as a context manager to register it only inside a block. ``TypeError`` if
    ``compiler`` does not follow :class:`~mfusion.autofuse.RegionCompiler`, ``ValueError``
    if another registered compiler has its name.
    """
    check_compiler(compiler)
    with _lock:
        if any(c.name == compiler.name for c in _registered):
            raise ValueError(
                f"a region compiler named {compiler.name!r} is already registered; "
                f"remove it first or choose another name"
            )
        _registered.append(compiler)
    return Registration(compiler)


def _collect(manager: Any) -> list[RegionCompiler]:
    calls = manager.collect(
        HOOK, lambda _plugin: RegionCompilerRegistry(), skipped="its region compilers are skipped"
    )
    return [compiler for _, registry in calls for compiler in registry]


def plugin_compilers() -> list[RegionCompiler]:
    """The compilers the plugins of the current Spore plugin manager provide (loads them)."""
    from spore.plugins import get_manager

    manager = get_manager()
    manager.load()
    with _lock:
        if manager not in _from_plugins:
            _from_plugins[manager] = _collect(manager)
        return list(_from_plugins[manager])


def region_compilers() -> list[RegionCompiler]:
    """The active compilers, in the order they get regions: registered in Python (oldest
    first), then the plugins' (by plugin name); a plugin's compiler whose name a Python one
    already has is left out."""
    with _lock:
        chosen = list(_registered)
    registered = {c.name for c in chosen}
    names = set(registered)
    for compiler in plugin_compilers():
        if compiler.name in names:
            level = logging.INFO if compiler.name in registered else logging.WARNING
            log.log(
                level,
                "region compiler %r from a plugin is left out: an earlier one has its name",
                compiler.name,
            )
            continue
        names.add(compiler.name)
        chosen.append(compiler)
    return chosen


def describe(compiler: RegionCompiler) -> str:
    """``module.Class:name:version``: what ``compiler`` is, the same in every process."""
    kind = type(compiler)
    version = getattr(compiler, "version", "")
    return f"{kind.__module__}.{kind.__qualname__}:{compiler.name}:{version}"


def identity(compiler: RegionCompiler) -> str:
    """:func:`describe` then ``#serial``: the serial tells apart compiler objects of one
    process."""
    with _lock:
        held = _serials.get(id(compiler))
        if held is None:  # the entry keeps the compiler alive, so its id is never reused
            held = _serials[id(compiler)] = (compiler, next(_counter))
    return f"{describe(compiler)}#{held[1]}"
