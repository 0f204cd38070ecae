"""The pre-grad (dynamo, torch-level) graph seen in aten terms, so aten-level matchers walk it.

Dynamo's graph writes one computation many ways (``operator.mul``, ``torch.mul``, the method
``mul``; ``x.to(torch.float32)``, ``x.float()``, ``x.type_as(y)``; ``x.pow(2)``,
``x ** 2``, ``torch.square(x)``). :func:`aten_view` copies such a graph node for node into a
separate graph in which each of these is the aten overload the post-grad stage holds
(``aten.mul.Tensor``, ``prims.convert_element_type``, ``aten.pow.Tensor_Scalar``,
``aten.mean.dim``, ...), with the fake values of the original (``meta["example_value"]``) and
a map back to the original nodes. A dtype cast to the dtype a tensor already has (a no-op,
which the post-grad graph does not hold) is folded into its input. Every other node is copied
unchanged, so a matcher finds only the forms it knows. The view is for reading: rewrites go
into the original graph, at the nodes the map gives.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_arg

aten = torch.ops.aten
prims = torch.ops.prims

_BINARY = {
    aten.add.Tensor: ((operator.add, torch.add), "add"),
    aten.mul.Tensor: ((operator.mul, torch.mul), "mul"),
    aten.sub.Tensor: ((operator.sub, torch.sub), "sub"),
}
_CASTS = {"to", "float", "half", "bfloat16", "double", "type_as", "type"}


@dataclass
class AtenView:
    """A copy of a graph in aten terms and, per copied node, the original nodes it stands for
    (the node itself first, then the no-op casts folded into it)."""

    graph: Graph
    origin: dict[Node, list[Node]]

    def original(self, node: Any) -> Any:
        """The original node ``node`` of the view stands for (non-nodes pass through)."""
        return self.origin[node][0] if isinstance(node, Node) else node

    def originals(self, nodes: list[Node]) -> list[Node]:
        """Every original node the view's ``nodes`` stand for, folded casts included."""
        return [o for n in nodes for o in self.origin[n]]


def value(node: Any) -> Any:
    """A node's fake value: ``meta["val"]`` (aten graphs) or ``meta["example_value"]``."""
    if not isinstance(node, Node):
        return None
    found = node.meta.get("val")
    return node.meta.get("example_value") if found is None else found


def _is_call(node: Node, functions: tuple[Callable[..., Any], ...], method: str) -> bool:
    if node.op == "call_function":
        return node.target in functions
    return node.op == "call_method" and node.target == method


def _scalar(arg: Any) -> bool:
    return isinstance(arg, (int, float)) and not isinstance(arg, bool)


def _dims(dim: Any) -> list[int] | None:
    if isinstance(dim, int):
        return [dim]
    if isinstance(dim, (list, tuple)) and all(isinstance(d, int) for d in dim):
        return list(dim)
    return None


def _mean(node: Node) -> tuple[Any, tuple[Any, ...], dict[str, Any]] | None:
    """``aten.mean.dim(x, dims, keepdim)`` for ``x.mean(dim, keepdim=...)``/``torch.mean``."""
    x, *rest = node.args
    dim = rest[0] if rest else node.kwargs.get("dim")
    keepdim = rest[1] if len(rest) > 1 else node.kwargs.get("keepdim", False)
    dims = _dims(dim)
    if dims is None or not isinstance(keepdim, bool) or len(rest) > 2:
        return None
    kwargs = {"dtype": node.kwargs["dtype"]} if node.kwargs.get("dtype") is not None else {}
    return aten.mean.dim, (x, dims, keepdim), kwargs


def _cast(node: Node) -> torch.dtype | None:
    """The dtype a tensor method casts its input to (same shape and device), or None."""
    if node.op != "call_method" or node.target not in _CASTS or not node.args:
        return None
    source, result = value(node.args[0]), value(node)
    if not isinstance(source, torch.Tensor) or not isinstance(result, torch.Tensor):
        return None
    if result.shape != source.shape or result.device != source.device:
        return None
    return result.dtype


def aten_spec(node: Node) -> tuple[Any, tuple[Any, ...], dict[str, Any]] | None:
    """``(aten target, args, kwargs)`` for a torch-level node the view rewrites, else None."""
    if node.op not in ("call_function", "call_method"):
        return None
    for target, (functions, method) in _BINARY.items():
        if _is_call(node, functions, method) and len(node.args) == 2:
            alpha = {"alpha": node.kwargs["alpha"]} if "alpha" in node.kwargs else {}
            if set(node.kwargs) - {"alpha"}:
                return None
            return target, tuple(node.args), alpha
    if _is_call(node, (torch.rsqrt,), "rsqrt") and len(node.args) == 1 and not node.kwargs:
        return aten.rsqrt.default, tuple(node.args), {}
    power = _is_call(node, (torch.pow, operator.pow), "pow") and len(node.args) == 2
    if power and _scalar(node.args[1]) and not node.kwargs:
        return aten.pow.Tensor_Scalar, tuple(node.args), {}
    if _is_call(node, (torch.square,), "square") and len(node.args) == 1 and not node.kwargs:
        return aten.pow.Tensor_Scalar, (node.args[0], 2), {}
    if _is_call(node, (torch.mean,), "mean") and node.args:
        return _mean(node)
    dtype = _cast(node)
    if dtype is not None:
        return prims.convert_element_type.default, (node.args[0], dtype), {}
    return None


def aten_view(gm: GraphModule) -> AtenView:
    """``gm``'s graph copied in aten terms (module doc), with the map back to ``gm``'s nodes."""
    graph = Graph()
    env: dict[Node, Node] = {}
    origin: dict[Node, list[Node]] = {}
    for node in gm.graph.nodes:
        spec = aten_spec(node)
        if spec is not None and spec[0] is prims.convert_element_type.default:
            source = value(node.args[0])
            if isinstance(source, torch.Tensor) and source.dtype == spec[1][1]:
                env[node] = env[node.args[0]]
                origin[env[node]].append(node)
                continue
        if spec is None:
            new = graph.node_copy(node, env.__getitem__)
        else:
            target, args, kwargs = spec
            new = graph.call_function(
                target, map_arg(args, env.__getitem__), map_arg(kwargs, env.__getitem__)
            )
            new.meta = dict(node.meta)
        env[node] = new
        origin[new] = [node]
    return AtenView(graph, origin)
