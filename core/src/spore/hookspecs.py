"""Every hook a Spore plugin can implement.

Plugins mark their implementations with :data:`spore.hookimpl` (defined here, beside
:data:`hookspec`, and re-exported by the package). Each hook hands the plugin an
object to call (a registry, the CLI group, the doctor report); plugins never touch globals.
Arguments are only ever added; a hook newer than a plugin's ``spore-core`` floor must be
implemented with ``@hookimpl(optionalhook=True)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import click

    from spore.doctor import Report
    from spore.registry import Registry

hookspec = pluggy.HookspecMarker("spore")

hookimpl = pluggy.HookimplMarker("spore")
"""Marker for plugin hook implementations: ``@spore.hookimpl def spore_doctor(report): ...``."""


@hookspec(historic=True)
def spore_addhooks(pluginmanager: pluggy.PluginManager) -> None:
    """Publish hook specifications of the plugin's own, with ``pluginmanager.add_hookspecs``.

    Historic: a plugin registered later still receives the call.

    .. versionadded:: 0.1.0
    """


@hookspec
def spore_register_ops(registry: Registry[Any]) -> None:
    """Define ops and add per-device kernels (a :class:`spore.registry.OpRegistry`).

    ``registry.define(name, schema, reference=...)`` creates ``torch.ops.spore.<name>``;
    ``registry.kernel(op, device, fn, priority=0, supports=None)`` adds this plugin's kernel.

    .. versionadded:: 0.1.0
    """


@hookspec
def spore_register_passes(registry: Registry[Any]) -> None:
    """Register graph passes: ``registry.add(pass_, stage="post_grad", priority=0, device=None)``.

    A :class:`spore.registry.PassRegistry`. The passes run in ``torch.compile(...,
    backend="spore")`` and after :func:`spore.passes.enable`, not in a plain compile.

    .. versionadded:: 0.1.0
    """


@hookspec
def spore_register_backends(registry: Registry[Any]) -> None:
    """Register compile backends: ``registry.add(spore.backends.Backend(name, compiler_fn))``.

    .. versionadded:: 0.1.0
    """


@hookspec
def spore_register_benchmarks(registry: Registry[Any]) -> None:
    """Register :class:`spore.bench.Benchmark` cases for ``spore bench``.

    .. versionadded:: 0.1.0
    """


@hookspec
def spore_add_commands(cli: click.Group) -> None:
    """Add subcommands to the ``spore`` command line, e.g. ``@cli.command() def train(): ...``.

    .. versionadded:: 0.1.0
    """


@hookspec(firstresult=True)
def spore_init_process_group(backend: str | None, options: dict[str, Any]) -> Any:
    """Start the default ``torch.distributed`` process group, e.g. in the background.

    ``options`` are the remaining keyword arguments of ``init_process_group``. Return a handle
    with ``wait(timeout=None)`` (blocks until the group is ready, raising what init raised) and
    ``done()``, or ``None`` to decline; the first handle wins. With no taker the core starts the
    group synchronously. Callers use :func:`spore.distributed.init_process_group`.

    .. versionadded:: 0.1.0
    """


@hookspec
def spore_doctor(report: Report) -> None:
    """Add environment checks to ``spore doctor`` with ``report.add(...)``.

    Skip checks that take seconds when ``report.quick`` is true.

    .. versionadded:: 0.1.0
    """
