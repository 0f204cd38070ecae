"""Named registries that remember which plugin registered each entry."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")

USER = "user"
"""Owner recorded for entries registered directly by user code, outside any plugin hook."""


class DuplicateRegistrationError(ValueError):
    """A name was registered twice without ``override=True``."""


@dataclass(frozen=True)
class Entry(Generic[T]):
    """One registered value and the plugin that registered it."""

    name: str
    value: T
    owner: str


class Registry(Generic[T]):
    """A name → value table for one kind of thing (``"benchmark"``, ``"op"``, ...).

    Entries registered while the plugin manager calls a plugin's hook are owned by that
    plugin; the manager removes them again if the plugin fails.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry[T]] = {}
        self._owner = USER

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
        if not name:
            raise ValueError(f"a {self.kind} name must be a non-empty string")
        old = self._entries.get(name)
        if old is not None and not override:
            raise DuplicateRegistrationError(
                f"{self.kind} {name!r} is registered by both {old.owner!r} and "
                f"{self._owner!r}; rename one, disable one plugin, or pass override=True"
            )
        self._entries[name] = Entry(name, value, self._owner)
        return value

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

    def remove_owner(self, owner: str) -> None:
        """Forget every entry registered by ``owner``."""
        self._entries = {n: e for n, e in self._entries.items() if e.owner != owner}

    @contextmanager
    def owned_by(self, owner: str) -> Iterator[None]:
        """Attribute registrations made inside the block to ``owner``."""
        previous, self._owner = self._owner, owner
        try:
            yield
        finally:
            self._owner = previous

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
    torch is imported on first use, not when the registry is created.
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
    ) -> Any:
        """:func:`spore.dispatch.register_kernel` with the calling plugin as provider."""
        from spore import dispatch

        kernel = dispatch.register_kernel(
            op,
            device,
            fn,
            provider=self._owner,
            priority=priority,
            supports=supports,
            override=override,
        )
        self.add(kernel, name=f"{kernel.op}[{device}]@{self._owner}", override=True)
        return kernel

    def remove_owner(self, owner: str) -> None:
        """Forget ``owner``'s entries and withdraw its kernels from dispatch."""
        super().remove_owner(owner)
        dispatch = sys.modules.get("spore.dispatch")
        if dispatch is not None:
            dispatch.unregister_provider(owner)
