"""dvm: a fused-kernel virtual machine for elementwise, broadcast and row-reduction regions.

``torch.compile(model, backend="dvm")`` clusters the forward and backward graphs into VM
regions; ``dvm.explain(fn, *inputs)`` shows the regions, their programs and why anything was
left to eager; with mfusion installed, dvm also compiles mfusion's automatic-fusion regions.
"""

from __future__ import annotations

from typing import Any

from dvm._version import __version__

_LAZY = {
    "Op": "dvm.program",
    "Instr": "dvm.program",
    "Program": "dvm.program",
    "run": "dvm.vm",
    "compile_graph": "dvm.compile",
    "explain": "dvm.explanation",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dvm' has no attribute {name!r}")


__all__ = ["__version__", *_LAZY]
