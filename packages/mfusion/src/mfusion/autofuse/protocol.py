"""The region-compiler protocol: what a package implements to compile automatic-fusion regions."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@runtime_checkable
class RegionCompiler(Protocol):
    """Compiles a region of a post-grad (aten-level) graph into one callable.

    ``name`` is short and unique among compilers (it appears in logs and op names).
    ``supports(node)`` says whether a ``call_function`` node may join a region; its fake
    value (dtype, shape, strides, device) is ``node.meta["val"]``.
    ``compile(region_graph, example_inputs)`` returns a callable that takes the region's input
    tensors (in ``region_graph``'s placeholder order) and returns its output tensors (a tuple
    in the order of ``region_graph``'s output, or the tensor itself for one output).

    An optional string attribute ``version`` goes into the FX graph cache key: change it when
    the code a compiler produces changes.
    """

    name: str

    def supports(self, node: torch.fx.Node) -> bool: ...

    def compile(
        self, region_graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]
    ) -> Callable[..., Any]: ...


def check_compiler(compiler: object) -> RegionCompiler:
    """``compiler`` itself if it follows :class:`RegionCompiler`, else a ``TypeError`` saying
    what it lacks."""
    name = getattr(compiler, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(
            f"a region compiler needs a non-empty string attribute 'name'; "
            f"{type(compiler).__name__} has {name!r}"
        )
    missing = [m for m in ("supports", "compile") if not callable(getattr(compiler, m, None))]
    if missing:
        raise TypeError(
            f"region compiler {name!r} ({type(compiler).__name__}) lacks the method(s) "
            f"{', '.join(missing)}; see mfusion.autofuse.RegionCompiler"
        )
    return compiler  # type: ignore[return-value]
