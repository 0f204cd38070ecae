"""Which plugins may load: the environment's selection and entry-point discovery.

Nothing here imports a plugin. Discovery reads the ``spore.plugins`` entry-point metadata; the
allow/deny environment and the ``spore-core`` range check give a plugin its status before
anything is imported. Loading, and isolating a plugin that fails, is :mod:`spore.plugins`.

Environment, highest precedence first:

``SPORE_NO_PLUGINS=1``
    no third-party plugin is loaded.
``SPORE_PLUGINS=a,b``
    allow-list: only these are loaded (set but empty: none); each is *requested*.
``SPORE_DISABLE_PLUGINS=a,b``
    deny-list; a name no installed plugin has (a typo, or ``core``, which cannot be disabled)
    is logged as a warning when the plugins load.
``SPORE_STRICT_PLUGINS=1``
    any plugin failure raises :class:`spore.plugins.PluginError` instead of a warning.
"""

from __future__ import annotations

import enum
import importlib.metadata as metadata
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from spore._version import __version__

ENTRY_POINT_GROUP = "spore.plugins"
CORE_PLUGIN = "core"
CORE_DISTRIBUTION = "spore-core"


class Status(enum.StrEnum):
    """Where a plugin stands after discovery and loading."""

    ACTIVE = "active"
    DISABLED = "disabled"
    FAILED = "failed"
    INCOMPATIBLE = "incompatible"


@dataclass
class PluginInfo:
    """One discovered plugin: where it comes from, its status and what it registered."""

    name: str
    distribution: str
    version: str
    value: str
    status: Status | None = None
    reason: str = ""
    core_requirement: str | None = None
    builtin: bool = False
    hooks: list[str] = field(default_factory=list)
    registered: dict[str, list[str]] = field(default_factory=dict)
    entry_point: metadata.EntryPoint | None = field(default=None, repr=False, compare=False)

    @property
    def label(self) -> str:
        """How messages name it: ``spore plugin 'name' (distribution version)``."""
        return f"spore plugin {self.name!r} ({self.distribution} {self.version})"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready view (what ``spore plugins --json`` prints)."""
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "module": self.value,
            "status": self.status.value if self.status else None,
            "reason": self.reason,
            "core_requirement": self.core_requirement,
            "builtin": self.builtin,
            "hooks": list(self.hooks),
            "registered": {k: list(v) for k, v in self.registered.items() if v},
        }


def normalize(name: str) -> str:
    """Plugin names compare case-insensitively with ``-`` and ``_`` equal."""
    return name.strip().lower().replace("_", "-")


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def _names(value: str) -> list[str]:
    return [normalize(n) for n in value.split(",") if n.strip()]


@dataclass(frozen=True)
class Selection:
    """Which plugins the environment lets load, and whether a failure is fatal.

    See the module docstring for the variables and their precedence.
    """

    no_plugins: bool = False
    allow: frozenset[str] | None = None
    deny: frozenset[str] = frozenset()
    strict: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Selection:
        strict = _truthy(env.get("SPORE_STRICT_PLUGINS"))
        if _truthy(env.get("SPORE_NO_PLUGINS")):
            return cls(no_plugins=True, strict=strict)
        if "SPORE_PLUGINS" in env:
            return cls(allow=frozenset(_names(env["SPORE_PLUGINS"])), strict=strict)
        return cls(deny=frozenset(_names(env.get("SPORE_DISABLE_PLUGINS", ""))), strict=strict)

    def why_disabled(self, name: str) -> str | None:
        """The reason ``name`` may not load, or ``None`` when it may."""
        key = normalize(name)
        if self.no_plugins:
            return "SPORE_NO_PLUGINS is set"
        if self.allow is not None and key not in self.allow:
            return "not listed in SPORE_PLUGINS"
        if key in self.deny:
            return "listed in SPORE_DISABLE_PLUGINS"
        return None


class MetadataError(ValueError):
    """A plugin distribution's metadata cannot be read (e.g. a malformed requirement)."""


def _core_requirement(dist: metadata.Distribution | None) -> str | None:
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    for line in (dist.requires or []) if dist else []:
        try:
            req = Requirement(line)
        except InvalidRequirement as exc:
            raise MetadataError(
                f"its metadata has a malformed requirement {line!r}: {exc}"
            ) from None
        if canonicalize_name(req.name) != CORE_DISTRIBUTION:
            continue
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            return str(req.specifier)
    return None


def _incompatibility(info: PluginInfo) -> str | None:
    from packaging.specifiers import SpecifierSet

    if info.core_requirement is None:
        return None
    spec = SpecifierSet(info.core_requirement)
    if spec.contains(__version__, prereleases=True):
        return None
    return (
        f"requires spore-core{spec} but spore-core {__version__} is running; install "
        f"'spore-core{spec}' or a release of {info.distribution} that supports {__version__}"
    )


def discover_entry_points(selection: Selection) -> list[PluginInfo]:
    """Read the ``spore.plugins`` entry points (metadata only, nothing is imported).

    De-duplicated by (distribution, name), sorted by name; disabled and incompatible plugins
    get their status here.
    """
    from packaging.utils import canonicalize_name

    found: dict[str, PluginInfo] = {}
    seen: set[tuple[str, str]] = set()
    eps = metadata.entry_points(group=ENTRY_POINT_GROUP)
    for ep in sorted(eps, key=lambda e: (normalize(e.name), e.dist.name if e.dist else "")):
        dist_name = ep.dist.name if ep.dist else "unknown"
        key = (canonicalize_name(dist_name), normalize(ep.name))
        if key in seen:
            continue
        seen.add(key)
        try:
            core_requirement, bad_metadata = _core_requirement(ep.dist), None
        except MetadataError as exc:
            core_requirement, bad_metadata = None, str(exc)
        info = PluginInfo(
            name=normalize(ep.name),
            distribution=dist_name,
            version=ep.dist.version if ep.dist else "unknown",
            value=ep.value,
            core_requirement=core_requirement,
            entry_point=ep,
        )
        other = found.get(info.name)
        if info.name == CORE_PLUGIN:
            info.status = Status.FAILED
            info.reason = f"the plugin name {CORE_PLUGIN!r} is reserved for spore-core"
        elif other is not None:
            info.status = Status.FAILED
            info.reason = (
                f"plugin name {info.name!r} is also provided by {other.distribution} "
                f"{other.version}; uninstall one of the two distributions"
            )
            found[f"{info.name}@{dist_name}"] = info
            continue
        elif (why := selection.why_disabled(info.name)) is not None:
            info.status, info.reason = Status.DISABLED, why
        elif bad_metadata is not None:
            info.status, info.reason = Status.FAILED, bad_metadata
        elif (why := _incompatibility(info)) is not None:
            info.status, info.reason = Status.INCOMPATIBLE, why
        found[info.name] = info
    return list(found.values())


__all__ = [
    "CORE_DISTRIBUTION",
    "CORE_PLUGIN",
    "ENTRY_POINT_GROUP",
    "PluginInfo",
    "Selection",
    "Status",
    "discover_entry_points",
    "normalize",
]
