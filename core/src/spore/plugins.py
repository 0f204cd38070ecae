"""Loading plugins, isolating their failures, and the process-wide manager.

:mod:`spore.discovery` says which plugins may load (environment and entry points, nothing
imported). The :class:`PluginManager` loads them once, the first time a registry is used, and
isolates every plugin import and hook call: a failure marks that plugin ``failed`` (its
registrations are withdrawn) and the host goes on, unless strict mode is on or the user asked
for that plugin by name. The manager fills the registries of :mod:`spore.registry`; the
mechanisms that use them (dispatch, passes, backends, bench) receive a registry and never
import this module.
"""

from __future__ import annotations

import difflib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import pluggy

from spore import hookspecs
from spore._version import __version__
from spore.discovery import (
    CORE_DISTRIBUTION,
    CORE_PLUGIN,
    ENTRY_POINT_GROUP,
    PluginInfo,
    Selection,
    Status,
    discover_entry_points,
    normalize,
)
from spore.errors import PluginError
from spore.registry import Registry, make_registries

if TYPE_CHECKING:
    import click

    from spore.doctor import Report

REGISTRY_HOOKS = {
    "ops": "spore_register_ops",
    "passes": "spore_register_passes",
    "backends": "spore_register_backends",
    "benchmarks": "spore_register_benchmarks",
}

log = logging.getLogger("spore.plugins")
T = TypeVar("T")


class PluginManager:
    """Finds, loads and isolates Spore plugins and owns the registries they fill.

    Loading is lazy (:meth:`load` runs on first registry use), happens once, is thread-safe
    and re-entrant: a plugin that touches a registry while being loaded does not recurse.
    """

    def __init__(
        self,
        env: Mapping[str, str] | None = None,
        *,
        requested: Iterable[str] = (),
        strict: bool | None = None,
    ) -> None:
        env = dict(os.environ if env is None else env)
        self.selection = Selection.from_env(env)
        self.strict = self.selection.strict if strict is None else strict
        self.requested: set[str] = {normalize(n) for n in requested}
        if self.selection.allow:
            self.requested |= self.selection.allow
        self.registries: dict[str, Registry[Any]] = make_registries()
        self._lock = threading.RLock()
        self._state = "new"
        self._error: Exception | None = None
        self._discovered: list[PluginInfo] | None = None
        self._infos: dict[str, PluginInfo] = {}
        self._commands: dict[str, list[str]] = {}
        self.notes: list[str] = []  # what loading logged about the selection (spore plugins)
        self._cli: click.Group | None = None
        self.pm = pluggy.PluginManager("spore")
        self.pm.add_hookspecs(hookspecs)

    # discovery -----------------------------------------------------------------------------
    def discover(self) -> list[PluginInfo]:
        """Third-party plugins found through entry points (cached; imports nothing)."""
        with self._lock:
            if self._discovered is None:
                self._discovered = discover_entry_points(self.selection)
            return list(self._discovered)

    def request(self, names: Iterable[str]) -> None:
        """Mark plugins as asked for by name: they must load, or :class:`PluginError` is raised.

        Names that are already loaded are checked at once.
        """
        new = {normalize(n) for n in names}
        with self._lock:
            self.requested |= new
            if self._state == "loaded":
                self._check_requested(new)

    # loading -------------------------------------------------------------------------------
    def load(self) -> None:
        """Import and register every selected plugin and fill the registries (once)."""
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._state != "new":
                return
            self._state = "loading"
            try:
                self._load()
                self._check_requested(self.requested)
            except Exception as exc:  # every later call raises it too, never empty registries
                self._error = exc
                self._state = "loaded"
                raise
            except BaseException as interrupt:  # Ctrl-C, a test's skip: undone, loaded again
                self._undo_load(interrupt)
                raise
            self._state = "loaded"

    def _undo_load(self, interrupt: BaseException) -> None:
        """Undo a load that ``interrupt`` stopped midway; where undoing fails too, every later
        use raises a :class:`PluginError` saying so, never half-filled registries."""
        try:
            self._unload()
        except BaseException as exc:
            self._error = PluginError(
                f"loading the plugins was interrupted ({type(interrupt).__name__}) and undoing "
                f"it failed ({type(exc).__name__}: {exc}), leaving the registries half-filled; "
                f"start a new process"
            )
            self._error.__cause__ = exc
            self._state = "loaded"

    def _unload(self) -> None:
        """Withdraw what a load interrupted midway registered and forget what it found, so
        that the next use loads from the start (a new pluggy manager: the historic
        ``spore_addhooks`` call and the hooks it added are gone too)."""
        ran = [n for n, i in self._infos.items() if i.status in (None, Status.ACTIVE)]
        for registry in self.registries.values():
            for name in ran:  # not a disabled plugin's (its import-time kernels stay)
                registry.remove_owner(name)
        self.pm = pluggy.PluginManager("spore")
        self.pm.add_hookspecs(hookspecs)
        self._infos = {}
        self._discovered = None
        self.notes = []
        self._state = "new"

    def _load(self) -> None:
        from spore import builtin

        self.pm.hook.spore_addhooks.call_historic(kwargs={"pluginmanager": self.pm})
        core = PluginInfo(
            name=CORE_PLUGIN,
            distribution=CORE_DISTRIBUTION,
            version=__version__,
            value=builtin.__name__,
            builtin=True,
        )
        self._infos[CORE_PLUGIN] = core
        self.pm.register(builtin, name=CORE_PLUGIN)
        core.hooks = sorted(h.name for h in self.pm.get_hookcallers(builtin) or [])
        self._warn_unknown_denied()
        for info in self.discover():
            self._infos.setdefault(info.name, info)
            if info.status is None:
                self._import_and_register(info)
            elif (  # found failed (a name clash, bad metadata) and not switched off
                info.status is Status.FAILED
                and self.strict
                and self.selection.why_disabled(info.name) is None
            ):
                raise PluginError(f"{info.label} {info.reason}")
        self._check_unknown_hooks()
        for kind, hookname in REGISTRY_HOOKS.items():
            registry = self.registries[kind]
            self._call_each(
                hookname,
                lambda name, r=registry: r.owned_by(name, self._infos[name].version),
                registry=registry,
            )
        for info in self._infos.values():
            if info.status is None:
                info.status = Status.ACTIVE

    def _warn_unknown_denied(self) -> None:
        """A name in ``SPORE_DISABLE_PLUGINS`` that no installed plugin has (a typo leaves the
        plugin meant enabled; ``core`` cannot be disabled) is logged with the closest
        installed name, and kept in :attr:`notes`."""
        installed = sorted({i.name for i in self.discover()})
        for name in sorted(self.selection.deny - set(installed)):
            note = (
                f"SPORE_DISABLE_PLUGINS names {name!r}, which is not an installed plugin "
                f"({self._unknown_hint(name)}installed: {', '.join(installed) or 'none'})"
            )
            self.notes.append(note)
            log.warning("%s", note)

    def _import_and_register(self, info: PluginInfo) -> None:
        assert info.entry_point is not None
        try:
            module = info.entry_point.load()
        except (Exception, SystemExit) as exc:  # a plugin's sys.exit() must not end the host
            self._fail(info, f"import of {info.value!r} failed", exc)
            return
        try:
            self.pm.register(module, name=info.name)
        except Exception as exc:
            self._fail(info, "registration failed", exc)
            return
        info.hooks = sorted(h.name for h in self.pm.get_hookcallers(module) or [])

    def _check_unknown_hooks(self) -> None:
        known = sorted(n for n, c in vars(self.pm.hook).items() if c.has_spec())
        for info in list(self._infos.values()):
            plugin = self.pm.get_plugin(info.name)
            if plugin is None or info.status is not None:
                continue
            for caller in self.pm.get_hookcallers(plugin) or []:
                impls = [i for i in caller.get_hookimpls() if i.plugin is plugin]
                if caller.has_spec() or all(i.optionalhook for i in impls):
                    continue
                close = difflib.get_close_matches(caller.name, known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                exc = pluggy.PluginValidationError(
                    plugin, f"hook {caller.name!r} has no specification{hint}"
                )
                self._fail(info, "implements an unknown hook", exc)
                break

    def _impls(self, hookname: str) -> list[Any]:
        """Implementations of ``hookname``: the core's first, then by plugin name."""
        return sorted(
            getattr(self.pm.hook, hookname).get_hookimpls(),
            key=lambda i: (i.plugin_name != CORE_PLUGIN, i.plugin_name),
        )

    def _call_each(
        self,
        hookname: str,
        scope: Callable[[str], AbstractContextManager[Any]],
        **kwargs: Any,
    ) -> None:
        """Call ``hookname`` on each live plugin separately, core first, then by name."""
        impls = self._impls(hookname)
        for impl in impls:
            info = self._infos[impl.plugin_name]
            if info.status not in (None, Status.ACTIVE):
                continue
            args = {name: kwargs[name] for name in impl.argnames}
            try:
                with scope(impl.plugin_name):
                    impl.function(**args)
            except (Exception, SystemExit) as exc:  # as at import: not the host's exit
                self._fail(info, f"hook {hookname} raised", exc)

    def _fail(self, info: PluginInfo, what: str, exc: BaseException) -> None:
        info.status = Status.FAILED
        info.reason = f"{what}: {type(exc).__name__}: {exc}"
        for registry in self.registries.values():
            registry.remove_owner(info.name)
        if self._cli is not None:
            for command in self._commands.pop(info.name, []):
                self._cli.commands.pop(command, None)
        if self.pm.get_plugin(info.name) is not None:
            self.pm.unregister(name=info.name)
        message = f"{info.label} {what}"
        if info.builtin or self.strict or info.name in self.requested:
            raise PluginError(f"{message}: {exc}") from exc
        log.warning("%s: %s: %s; continuing without it", message, type(exc).__name__, exc)

    def _unknown_hint(self, name: str) -> str:
        """What to say of ``name``, denied but not installed: :func:`name_hint`, or for
        ``core`` that it cannot be disabled."""
        if normalize(name) in (CORE_PLUGIN, CORE_DISTRIBUTION):
            return (
                "it is spore-core's built-in plugin, which cannot be disabled; to load no other "
                "plugin, set SPORE_NO_PLUGINS=1; "
            )
        hint = name_hint(name, self.discover())
        return f"{hint} " if hint else ""

    def _check_requested(self, names: Iterable[str]) -> None:
        for name in sorted(names):
            info = self._infos.get(name)
            if info is None:
                known = list(self._infos.values())  # spore-core's own plugin included
                hint = name_hint(name, known)
                have = ", ".join(sorted(i.name for i in known))
                raise PluginError(
                    f"spore plugin {name!r} was asked for but is not installed "
                    f"({hint + ' ' if hint else ''}installed plugins: {have})"
                )
            if info.status is not Status.ACTIVE:
                raise PluginError(
                    f"{info.label} was asked for but is "
                    f"{info.status.value if info.status else 'not loaded'}: {info.reason}"
                )

    # what the host uses --------------------------------------------------------------------
    def registry(self, kind: str) -> Registry[Any]:
        """The registry of ``kind`` (``ops``, ``passes``, ``backends``, ``benchmarks``)."""
        if kind not in self.registries:
            raise KeyError(f"unknown registry {kind!r}; choose from {', '.join(self.registries)}")
        self.load()
        return self.registries[kind]

    def plugins(self, *, include_builtin: bool = False) -> list[PluginInfo]:
        """Every discovered plugin with its status and registrations (loads plugins)."""
        self.load()
        infos = [i for i in self._infos.values() if include_builtin or not i.builtin]
        for info in infos:
            info.registered = {
                kind: registry.names(owner=info.name) for kind, registry in self.registries.items()
            }
            info.registered["commands"] = list(self._commands.get(info.name, []))
        listed = {(i.name, i.distribution) for i in infos}
        for info in self.discover():  # those never loaded, a second one of a name included
            if (info.name, info.distribution) not in listed and not info.builtin:
                infos.append(info)
        return sorted(infos, key=lambda i: (not i.builtin, i.name, i.distribution))

    def add_commands(self, cli: click.Group) -> None:
        """Let each live plugin add subcommands to ``cli``; a clash fails the later plugin."""
        self.load()
        with self._lock:
            if self._cli is cli:
                return
            self._cli = cli
            try:
                self._call_each("spore_add_commands", self._commands_scope, cli=cli)
            except BaseException as exc:
                # Ctrl-C, a test's skip: undone, the next call adds again. A plugin error (an
                # Exception) is not: the failed plugin's commands are withdrawn, the others kept
                if not isinstance(exc, Exception):
                    self._withdraw_commands(cli)
                raise

    def _withdraw_commands(self, cli: click.Group) -> None:
        """Take the commands plugins added out of ``cli`` and forget them and ``cli``."""
        for names in self._commands.values():
            for name in names:
                cli.commands.pop(name, None)
        self._commands = {}
        self._cli = None

    @contextmanager
    def _commands_scope(self, owner: str) -> Iterator[None]:
        assert self._cli is not None
        commands = self._cli.commands
        before = dict(commands)
        try:
            yield
        finally:
            added = [n for n, c in commands.items() if before.get(n) is not c]
            clashes = [n for n in added if n in before]
            if clashes:
                commands.clear()
                commands.update(before)
            else:
                self._commands[owner] = added
        if clashes:
            holder = next(
                (o for o, names in self._commands.items() if clashes[0] in names), "spore"
            )
            raise DuplicateCommandError(
                f"command {clashes[0]!r} is added by both {holder!r} and {owner!r}; "
                f"disable one of the two plugins"
            )

    def first_result(self, hookname: str, **kwargs: Any) -> tuple[str, Any] | None:
        """Call a ``firstresult`` hook on live plugins (core first, then by name).

        Returns ``(plugin name, result)`` for the first non-``None`` result. Exceptions are the
        caller's to handle: such hooks act for the caller (e.g. starting a process group).
        """
        self.load()
        impls = self._impls(hookname)
        for impl in impls:
            if self._infos[impl.plugin_name].status is not Status.ACTIVE:
                continue
            result = impl.function(**{name: kwargs[name] for name in impl.argnames})
            if result is not None:
                return impl.plugin_name, result
        return None

    def collect(
        self, hookname: str, make: Callable[[str], T], *, skipped: str
    ) -> list[tuple[str, T]]:
        """Call a hook a plugin published (through ``spore_addhooks``) on each live plugin, by
        name, each with its own argument ``make(plugin_name)`` (e.g. a registry); returns the
        ``(plugin name, argument)`` pairs of the calls that returned. A plugin whose hook raises
        is left out with a warning ending in ``skipped`` (what it loses), or is a
        :class:`PluginError` under strict mode or when the plugin was asked for by name. A hook
        nobody published gives ``[]``.

        .. versionadded:: 0.1.0
        """
        self.load()
        caller = getattr(self.pm.hook, hookname, None)
        if caller is None:
            return []
        found: list[tuple[str, T]] = []
        for impl in sorted(caller.get_hookimpls(), key=lambda i: i.plugin_name):
            info = self._infos.get(impl.plugin_name)
            if info is not None and info.status not in (None, Status.ACTIVE):
                continue
            argument = make(impl.plugin_name)
            try:
                impl.function(**{name: argument for name in impl.argnames})
            except (Exception, SystemExit) as exc:  # as at import: not the host's exit
                message = f"spore plugin {impl.plugin_name!r}: hook {hookname} raised"
                if self.strict or impl.plugin_name in self.requested:
                    raise PluginError(f"{message}: {exc}") from exc
                log.warning("%s: %s: %s; %s", message, type(exc).__name__, exc, skipped)
                continue
            found.append((impl.plugin_name, argument))
        return found

    def run_doctor(self, report: Report) -> None:
        """Collect ``spore_doctor`` checks from the core and each live plugin."""
        self.load()
        self._call_each("spore_doctor", report.source, report=report)


def name_hint(name: str, infos: Iterable[PluginInfo]) -> str:
    """For ``name``, which no plugin of ``infos`` has: "did you mean 'kernels'?" naming the
    plugin whose distribution ``name`` is (``spore-kernels``), else the closest plugin name;
    ``""`` when none is close. Every message about a plugin name not found says it so."""
    key = normalize(name)
    infos = list(infos)
    for info in infos:
        if normalize(info.distribution) == key:
            return f"did you mean {info.name!r}, the plugin of distribution {info.distribution}?"
    close = difflib.get_close_matches(key, sorted({i.name for i in infos}), n=1)
    return f"did you mean {close[0]!r}?" if close else ""


class DuplicateCommandError(ValueError):
    """Two plugins added a CLI command of the same name."""


_manager: PluginManager | None = None
_manager_lock = threading.Lock()


def get_manager() -> PluginManager:
    """The process-wide manager (created on first use from ``os.environ``)."""
    global _manager
    with _manager_lock:
        if _manager is None:
            _manager = PluginManager()
        return _manager


@contextmanager
def use_manager(manager: PluginManager) -> Iterator[PluginManager]:
    """Make ``manager`` the process-wide one inside the block (for tests and embedders)."""
    global _manager
    with _manager_lock:
        previous, _manager = _manager, manager
    try:
        yield manager
    finally:
        with _manager_lock:
            _manager = previous


__all__ = [
    "CORE_DISTRIBUTION",
    "CORE_PLUGIN",
    "ENTRY_POINT_GROUP",
    "REGISTRY_HOOKS",
    "DuplicateCommandError",
    "PluginError",
    "PluginInfo",
    "PluginManager",
    "Selection",
    "Status",
    "discover_entry_points",
    "get_manager",
    "name_hint",
    "normalize",
    "use_manager",
]
