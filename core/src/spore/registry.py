"""Every registry: named tables that remember which plugin registered each entry.

The rule: every registry class lives here. :class:`Registry` is the table; a kind whose
entries act on something else has a subclass here that hands each entry to its mechanism
(:class:`OpRegistry` → :mod:`spore.dispatch`, :class:`PassRegistry` → the entry types of
:mod:`spore.graph_passes`, :class:`BackendRegistry` → :mod:`spore.backends`); one whose entries
must be of a mechanism's type checks it (:class:`BenchmarkRegistry`). Mechanisms define
their entry types and receive a registry (or its entries) as an argument; they never import
this module's subclasses, the plugin manager or the ``spore`` package. The plugin manager
(:mod:`spore.plugins`) creates one registry per kind with :func:`make_registries` and fills
them through the plugins' hooks.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from spore import backends, bench, graph_passes
from spore.errors import DuplicateRegistrationError, check_device_type, check_sub_provider

T = TypeVar("T")

USER = "user"
"""Owner recorded for entries registered directly by user code, outside any plugin hook."""


@dataclass(frozen=True)
class Entry(Generic[T]):
    """One registered value, the plugin that registered it and that plugin's version."""

    name: str
    value: T
    owner: str
    owner_version: str = ""


class Registry(Generic[T]):
    """A name → value table for one kind of thing (``"benchmark"``, ``"op"``, ...).

    Entries registered while the plugin manager calls a plugin's hook are owned by that
    plugin; the manager removes them again if the plugin fails, and an entry that one replaced
    with ``override=True`` comes back.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry[T]] = {}
        self._shadowed: dict[str, list[Entry[T]]] = {}  # replaced by another owner, oldest first
        self._owner = USER
        self._owner_version = ""

    def add(self, value: T, *, name: str | None = None, override: bool = False) -> T:
        """Register ``value`` under ``name`` (default: ``value.name``) and return it.

        Raises :class:`DuplicateRegistrationError` naming both owners when the name is taken,
        unless ``override=True``.
        """
        if name is None:
            name = getattr(value, "name", None)
            if not isinstance(name, str):
                raise TypeError(
                    f"cannot register {value!r} as a {self.kind}: it has no 'name' attribute; "
                    f"pass name=..."
                )
        if not isinstance(name, str):
            raise TypeError(f"a {self.kind} name must be a str, got {type(name).__name__} {name!r}")
        if not name:
            raise ValueError(f"a {self.kind} name must be a non-empty string")
        old = self._entries.get(name)
        if old is not None and not override:
            if old.owner == self._owner:
                raise DuplicateRegistrationError(
                    f"{self.kind} {name!r} is already registered by {old.owner!r}; use another "
                    f"name, or pass override=True to replace it"
                )
            raise DuplicateRegistrationError(
                f"{self.kind} {name!r} is registered by both {old.owner!r} and "
                f"{self._owner!r}; rename one, disable one plugin, or pass override=True"
            )
        if old is not None and old.owner != self._owner:
            self._shadowed.setdefault(name, []).append(old)
        self._entries[name] = Entry(name, value, self._owner, self._owner_version)
        return value

    def _undo_add(self, name: str, before: Entry[T] | None) -> None:
        """Put back the entry ``name`` had before the :meth:`add` that just succeeded."""
        if before is None:
            del self._entries[name]
            return
        shadowed = self._shadowed.get(name)
        if shadowed and shadowed[-1] is before:
            shadowed.pop()
        self._entries[name] = before

    def get(self, name: str) -> T:
        """Return the value registered as ``name``; ``KeyError`` lists the known names."""
        try:
            return self._entries[name].value
        except KeyError:
            known = ", ".join(sorted(self._entries)) or "none"
            raise KeyError(f"no {self.kind} named {name!r} (registered: {known})") from None

    def entry(self, name: str) -> Entry[T]:
        """Return the :class:`Entry` (value and owner) registered as ``name``."""
        self.get(name)
        return self._entries[name]

    def entries(self) -> list[Entry[T]]:
        """All entries, sorted by name."""
        return [self._entries[k] for k in sorted(self._entries)]

    def names(self, owner: str | None = None) -> list[str]:
        """Sorted names, optionally only those registered by ``owner``."""
        return sorted(n for n, e in self._entries.items() if owner is None or e.owner == owner)

    def remove_owner(self, owner: str) -> list[Entry[T]]:
        """Forget every entry registered by ``owner``; where one had replaced another owner's
        entry (``override=True``), that entry comes back. Returns the entries that came back."""
        for name, shadowed in list(self._shadowed.items()):
            shadowed[:] = [e for e in shadowed if e.owner != owner]
            if not shadowed:
                del self._shadowed[name]
        restored = []
        for name, entry in list(self._entries.items()):
            if entry.owner != owner:
                continue
            shadowed = self._shadowed.get(name)
            if not shadowed:
                del self._entries[name]
                continue
            self._entries[name] = shadowed.pop()
            restored.append(self._entries[name])
            if not shadowed:
                del self._shadowed[name]
        return restored

    @contextmanager
    def owned_by(self, owner: str, version: str = "") -> Iterator[None]:
        """Attribute registrations made inside the block to ``owner`` (at ``version``)."""
        previous = self._owner, self._owner_version
        self._owner, self._owner_version = owner, version
        try:
            yield
        finally:
            self._owner, self._owner_version = previous

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"<Registry {self.kind}: {len(self)} entries>"


class OpRegistry(Registry[Any]):
    """What ``spore_register_ops`` receives: define ops and add kernels, owned by the plugin.

    Entries are the ops a plugin defined (by name) and its kernels (``op[device]@plugin``).
    :mod:`spore.dispatch` (which imports torch) is imported on first use, not when the registry
    is created.
    """

    def define(self, name: str, schema: str, **kwargs: Any) -> Any:
        """:func:`spore.dispatch.define`, recorded as registered by the calling plugin."""
        from spore import dispatch

        op = dispatch.define(name, schema, **kwargs)
        self.add(op, name=name)
        return op

    def kernel(
        self,
        op: Any,
        device: str,
        fn: Callable[..., Any],
        *,
        priority: int = 0,
        supports: Callable[..., bool] | None = None,
        override: bool = False,
        provider: str | None = None,
    ) -> Any:
        """:func:`spore.dispatch.register_kernel` with the calling plugin as provider, or one
        of its sub-providers ``"<plugin>:<name>"`` (several kernels of one plugin for one op
        and device, e.g. one per attention backend).

        .. versionchanged:: 0.1.0 ``provider``
        """
        from spore import dispatch

        owner = self._owner
        if provider is None:
            provider = owner
        else:
            check_sub_provider(provider, owner, f"plugin {owner!r}")
        kernel = dispatch.register_kernel(
            op,
            device,
            fn,
            provider=provider,
            priority=priority,
            supports=supports,
            override=override,
        )
        self.add(kernel, name=f"{kernel.op}[{device}]@{provider}", override=True)
        return kernel

    def remove_owner(self, owner: str) -> list[Entry[Any]]:
        """Forget ``owner``'s entries and withdraw its kernels from dispatch."""
        restored = super().remove_owner(owner)
        dispatch = sys.modules.get("spore.dispatch")
        if dispatch is not None:
            dispatch.unregister_provider(owner)
        return restored


class PassRegistry(Registry[graph_passes.PassEntry]):
    """What ``spore_register_passes`` receives: ``registry.add(pass_, stage=..., priority=...)``.

    Registering runs nothing: the passes run in ``torch.compile(..., backend="spore")`` and,
    after :func:`spore.passes.enable`, in every Inductor compile (see :mod:`spore.passes`). A
    pass is named ``name``, else its ``name`` attribute, its ``__name__`` (a function) or its
    class's name.
    """

    def add(  # type: ignore[override]
        self,
        value: Any,
        *,
        name: str | None = None,
        override: bool = False,
        stage: str = "post_grad",
        priority: int = 0,
        device: str | None = None,
    ) -> graph_passes.PassEntry:
        graph_passes.check_stage(stage)
        if isinstance(value, type):
            raise TypeError(
                f"register an instance of the pass class {value.__name__}, not the class: "
                f"add({value.__name__}())"
            )
        if not callable(value):
            raise TypeError(f"a pass must be callable (gm) -> int, got {type(value).__name__}")
        if stage == "pre_grad" and isinstance(value, graph_passes.PatternToPatternPass):
            raise ValueError(
                f"{type(value).__name__} is a PatternToPatternPass: it matches aten graphs, and a "
                f"pre_grad graph holds torch-level calls, so it would never rewrite anything; "
                f"register it at stage='post_grad' (or 'joint'), or write a GraphPass for pre_grad"
            )
        if type(priority) is not int:  # a bool too: it would sort as 0/1 without a word
            raise TypeError(f"a pass's priority must be an int, got {priority!r}")
        if device is not None:
            check_device_type(device, "a pass's device (or None: every device)")
        name = name or getattr(value, "name", "") or getattr(value, "__name__", "")
        name = name or type(value).__name__
        entry = graph_passes.PassEntry(name, value, stage, priority, device)
        super().add(entry, name=name, override=override)
        return entry

    def for_stage(self, stage: str) -> list[graph_passes.PassEntry]:
        """The passes registered for ``stage``, by name."""
        return [e.value for e in self.entries() if e.value.stage == stage]


class BackendRegistry(Registry[backends.Backend]):
    """What ``spore_register_backends`` receives: ``registry.add(Backend(...))``.

    Each backend added is registered with ``torch._dynamo`` by :mod:`spore.backends`.
    """

    def add(
        self, value: backends.Backend, *, name: str | None = None, override: bool = False
    ) -> backends.Backend:
        if not isinstance(value, backends.Backend):
            raise TypeError(f"register a spore.backends.Backend, got {type(value).__name__}")
        if name not in (None, value.name):
            raise ValueError(f"backend {value.name!r} cannot be registered as {name!r}")
        before = self._entries.get(value.name)
        super().add(value, override=override)
        try:
            backends.register_with_dynamo(value)
        except BaseException:  # dynamo refused the name: the registry keeps what it had
            self._undo_add(value.name, before)
            raise
        return value

    def remove_owner(self, owner: str) -> list[Entry[backends.Backend]]:
        """Forget ``owner``'s backends: one it had replaced is dynamo's again, and dynamo's
        entries for the others then fail with a clear message."""
        owned = self.names(owner=owner)
        restored = super().remove_owner(owner)
        for entry in restored:
            backends.register_with_dynamo(entry.value)
        backends.withdraw([name for name in owned if name not in self])
        return restored


class BenchmarkRegistry(Registry[bench.Benchmark]):
    """What ``spore_register_benchmarks`` receives: ``registry.add(Benchmark(...))``."""

    def add(
        self, value: bench.Benchmark, *, name: str | None = None, override: bool = False
    ) -> bench.Benchmark:
        if not isinstance(value, bench.Benchmark):
            raise TypeError(f"register a spore.bench.Benchmark, got {type(value).__name__}")
        return super().add(value, name=name, override=override)


def make_registries() -> dict[str, Registry[Any]]:
    """A new, empty registry of each kind: ``ops``, ``passes``, ``backends``, ``benchmarks``."""
    return {
        "ops": OpRegistry("op"),
        "passes": PassRegistry("pass"),
        "backends": BackendRegistry("backend"),
        "benchmarks": BenchmarkRegistry("benchmark"),
    }


__all__ = [
    "USER",
    "BackendRegistry",
    "BenchmarkRegistry",
    "DuplicateRegistrationError",
    "Entry",
    "OpRegistry",
    "PassRegistry",
    "Registry",
    "make_registries",
]
