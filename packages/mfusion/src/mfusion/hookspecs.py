"""The hooks mfusion publishes for other Spore plugins (added through ``spore_addhooks``).

A package that compiles mfusion's automatic-fusion regions implements the hook in its own
Spore plugin module. mfusion may be absent or switched off, so mark the implementation
optional, or the core reports an unknown hook::

    @spore.hookimpl(optionalhook=True)
    def mfusion_register_region_compilers(registry):
        registry.add(MyRegionCompiler())
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from mfusion.autofuse.registry import RegionCompilerRegistry

hookspec = pluggy.HookspecMarker("spore")


@hookspec
def mfusion_register_region_compilers(registry: RegionCompilerRegistry) -> None:
    """Add region compilers for mfusion's automatic fusion: ``registry.add(compiler)``.

    A compiler follows :class:`mfusion.autofuse.RegionCompiler`. The hook is called once per
    plugin manager, at the first compile that runs the ``autofuse`` pass; a plugin whose hook
    raises is logged and skipped (an error under ``SPORE_STRICT_PLUGINS=1`` or when the plugin
    was asked for by name).

    .. versionadded:: 0.1.0
    """
