"""Automatic fusion as a post-grad pass: the long tail goes to the active region compilers.

It runs last among mfusion's passes (lowest priority), on what the hand-written passes left.
With no region compiler active it changes nothing. Its version names the active compilers;
while one is active its ``uuid()`` is ``None``, so Inductor's FX graph cache is bypassed where
the pass can run: the regions it outlines are ops of this process only, which a cached graph
in another process could not call.
"""

from __future__ import annotations

import hashlib
from typing import Any

from spore.graph_passes import GraphPass

BASE_VERSION = "1"


class AutoFuse(GraphPass):
    name = "autofuse"
    priority = -1000
    on_cpu = False  # Inductor fuses the pointwise tail itself; a region op costs a call
    summary = "Outline regions a registered region compiler supports into one custom op each."

    @property
    def version(self) -> str:  # type: ignore[override]
        """:data:`BASE_VERSION`, plus a hash of what the active compilers are (sorted: the
        same compilers give the same version in every process, in any order; where their
        order matters, the pass runs and ``uuid()`` bypasses the cache)."""
        from mfusion.autofuse.registry import describe, region_compilers

        compilers = region_compilers()
        if not compilers:
            return BASE_VERSION
        names = "\n".join(sorted(describe(c) for c in compilers))
        return f"{BASE_VERSION}+{hashlib.sha256(names.encode()).hexdigest()[:12]}"

    def uuid(self) -> str | None:
        """``None`` (Inductor then bypasses its FX graph cache) while a region compiler is
        active, else the version."""
        from mfusion.autofuse.registry import region_compilers

        return None if region_compilers() else self.version

    def __call__(self, gm: Any) -> int:
        from mfusion.autofuse import fuse, region_compilers

        compilers = region_compilers()
        return fuse(gm, compilers) if compilers else 0


PASSES = (AutoFuse(),)
