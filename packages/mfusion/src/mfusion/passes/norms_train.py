"""RMSNorm, Add+RMSNorm and LayerNorm in training: rewritten before autograd (pre-grad stage).

In a forward+backward compile AOT autograd partitions the traced graph, and the forward saves
what the decomposed backward needs (RMSNorm's ``rsqrt``, LayerNorm's mean and rstd); the
post-grad passes of :mod:`mfusion.passes.norms` then refuse those forms, whose intermediates
have users outside them. These passes run on dynamo's graph instead, before autograd, and put
``spore.rms_norm``, ``spore.add_rms_norm`` and ``spore.layer_norm`` there: AOT autograd keeps
each as one op in the forward graph and differentiates it with the op's registered backward
(``spore.*_backward``, one op in the backward graph, which saves only the op's inputs).

The RMSNorm forms, and what is left alone, are the post-grad passes' (the same matcher walks
:func:`mfusion.passes._torch_ir.aten_view` of the graph, with the same numerics decisions);
``F.layer_norm`` and ``F.rms_norm`` (also ``torch.layer_norm``/``torch.rms_norm``) over the
last dimension, with weight (and bias) of x's dtype or none and any eps (``F.rms_norm``'s
``None``, ``nn.RMSNorm``'s default, read as the epsilon eager uses), are one call each in
dynamo's graph and computed as the ops compute them (float32, one rounding: measured
bit-equal for bfloat16 ``F.rms_norm`` on CPU). Only a norm whose result requires grad is rewritten:
inference graphs stay with the post-grad passes. A form with an in-place op between its nodes
(dynamo's graph is not functional) is left alone.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Graph, GraphModule, Node
from torch.multiprocessing.reductions import StorageWeakRef

import spore
from mfusion.passes import norms
from mfusion.passes._torch_ir import AtenView, aten_view, value


def _trains(node: Node) -> bool:
    """Whether ``node``'s value requires grad (dynamo traced it with autograd on)."""
    found = value(node)
    return isinstance(found, torch.Tensor) and found.requires_grad


_IN_PLACE_OPERATORS = frozenset(
    getattr(operator, name)
    for name in (
        "setitem", "delitem", "iadd", "iand", "iconcat", "ifloordiv", "ilshift", "imatmul",
        "imod", "imul", "ior", "ipow", "irshift", "isub", "itruediv", "ixor",
    )
)  # fmt: skip
"""``t[i] = v``, ``del t[i]`` and ``t += v`` (...) as dynamo writes them: in place on a tensor,
though their names do not say so (Inductor's ``is_mutation_op`` reads the name)."""


def _mutation_free(graph: Graph, nodes: list[Node]) -> bool:
    """No in-place op between the first and the last of ``nodes`` in ``graph``'s order."""
    wanted, inside = set(nodes), False
    for node in graph.nodes:
        if node in wanted:
            wanted.discard(node)
            inside = bool(wanted)
            if not inside:
                return True
        elif inside and _writes_in_place(node):
            return False
    return not wanted


def _changed_later(graph: Graph, x: Node) -> bool:
    """Whether an in-place op after ``x`` writes its storage: ``x``, the tensor it is a view of,
    or any view of that (``x.T``, ``x.unfold(...)``, ``x.ravel()``...), told by their fake
    values sharing ``x``'s storage; a node without a fake value that takes such an alias first
    counts as one. A rewrite whose op saves ``x`` for its backward would then fail where eager
    saved a copy of its own. ``True`` when ``x`` has no fake value (nothing to tell by)."""
    storage = _storage(x)
    if storage is None:
        return True
    aliases: set[Node] = set()
    after = False
    for node in graph.nodes:
        first = node.args[0] if node.op in ("call_method", "call_function") and node.args else None
        shared = _storage(node)
        if shared is None:
            if isinstance(first, Node) and first in aliases:
                aliases.add(node)
        elif shared == storage:
            aliases.add(node)
        if after and isinstance(first, Node) and first in aliases and _writes_in_place(node):
            return True
        after = after or node is x
    return False


def _storage(node: Node) -> StorageWeakRef | None:
    """The storage of ``node``'s fake tensor value, ``None`` when it has none (not a tensor,
    or one without storage: sparse, nested)."""
    found = value(node)
    if not isinstance(found, torch.Tensor):
        return None
    try:
        return StorageWeakRef(found.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


def _writes_in_place(node: Node) -> bool:
    """An in-place op: an operator of :data:`_IN_PLACE_OPERATORS` (another of the operator
    module, ``a & b``'s ``and_``, is not, though its name ends in ``_``), else by its name
    (Inductor's ``is_mutation_op``)."""
    from torch._inductor.pattern_matcher import is_mutation_op

    if node.op == "call_function" and getattr(node.target, "__module__", None) == "_operator":
        return node.target in _IN_PLACE_OPERATORS
    return is_mutation_op(node)


class _Renamed:
    """The original nodes of a view's matches, through the replacements made so far."""

    def __init__(self, view: AtenView) -> None:
        self.view = view
        self.replaced: dict[Node, Node] = {}

    def __call__(self, node: Any) -> Any:
        node = self.view.original(node)
        while node in self.replaced:
            node = self.replaced[node]
        return node

    def match(self, found: norms.RMSNormMatch) -> norms.RMSNormMatch:
        """``found`` (a match in the view) in the original graph's nodes; its inner nodes
        include the no-op casts of x that only it uses."""
        inner = self.view.originals(found.inner)
        own = set(inner)
        casts = [c for c in self.view.origin[found.upcast][1:] if c.users and set(c.users) <= own]
        return norms.RMSNormMatch(
            x=self(found.x),
            weight=self(found.weight),
            eps=found.eps,
            out=self(found.out),
            upcast=self(found.upcast),
            inner=[*casts, *inner],
        )


def _training_rms_norms(gm: GraphModule) -> Iterator[tuple[norms.RMSNormMatch, bool, _Renamed]]:
    """``(match in gm's nodes, whether x is a plain sum, renaming)`` for every RMSNorm whose
    result requires grad, with no in-place op inside; record rewrites in the renaming."""
    view = aten_view(gm)
    renamed = _Renamed(view)
    for found in [m for n in list(view.graph.nodes) if (m := norms.match_rms_norm(n))]:
        match = renamed.match(found)
        if not _trains(match.out):
            continue
        if not _mutation_free(gm.graph, [match.x, *match.inner, match.out]):
            continue
        if _changed_later(gm.graph, match.x):
            continue
        # a sum an earlier rewrite replaced (by add_rms_norm's own) is no longer one
        plain = norms.plain_add(found.x) and match.x is renamed.view.original(found.x)
        yield match, plain, renamed


class _TrainingPass(spore.GraphPass):
    stage = "pre_grad"
    version = "9"
    on_cpu = False  # Inductor's fused forward and backward norm kernels are as fast on CPU


class _TrainingRMSNormPass(_TrainingPass):
    """Rewrites each training RMSNorm :meth:`rewrite` takes, recording the replacements."""

    def rewrite(self, graph: Graph, match: norms.RMSNormMatch, plain: bool) -> dict | None:
        raise NotImplementedError

    def __call__(self, gm: GraphModule) -> int:
        count = 0
        for match, plain, renamed in _training_rms_norms(gm):
            replaced = self.rewrite(gm.graph, match, plain)
            if replaced is not None:
                renamed.replaced.update(replaced)
                count += 1
        return count


class AddRMSNormTrainPass(_TrainingRMSNormPass):
    """In training, ``rms_norm(a + b)`` → ``spore.add_rms_norm`` before autograd."""

    name = "add_rms_norm_train"
    priority = 30
    summary = "training: residual add + RMSNorm → spore.add_rms_norm (pre-grad, op's backward)"

    def rewrite(self, graph: Graph, match: norms.RMSNormMatch, plain: bool) -> dict | None:
        anchor = norms.add_rms_norm_anchor(graph, match) if plain else None
        return None if anchor is None else norms.rewrite_add_rms_norm(graph, match, anchor)


class RMSNormTrainPass(_TrainingRMSNormPass):
    """In training, every RMSNorm form the op computes (and ``F.rms_norm``) → spore.rms_norm."""

    name = "rms_norm_train"
    priority = 25
    summary = "training: RMSNorm forms and F.rms_norm → spore.rms_norm (pre-grad, op's backward)"

    def rewrite(self, graph: Graph, match: norms.RMSNormMatch, plain: bool) -> dict | None:
        return norms.rewrite_rms_norm(graph, match)

    def __call__(self, gm: GraphModule) -> int:
        return super().__call__(gm) + _rewrite_functional(gm.graph, F.rms_norm, "rms_norm")


class LayerNormTrainPass(_TrainingPass):
    """In training, ``F.layer_norm`` over the last dimension → spore.layer_norm."""

    name = "layer_norm_train"
    priority = 25
    summary = "training: F.layer_norm → spore.layer_norm (pre-grad, op's backward)"

    def __call__(self, gm: GraphModule) -> int:
        return _rewrite_functional(gm.graph, F.layer_norm, "layer_norm")


_TORCH = {F.rms_norm: torch.rms_norm, F.layer_norm: torch.layer_norm}


def _functional_args(node: Node, function: Callable[..., Any]) -> dict[str, Any] | None:
    """``node``'s arguments by ``function``'s parameter names when it calls ``function``
    (or its ``torch.*`` twin), else None."""
    if node.op != "call_function" or node.target not in (function, _TORCH[function]):
        return None
    try:
        bound = inspect.signature(function).bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def _functional_norm(node: Node, function: Callable[..., Any]) -> tuple[Any, ...] | None:
    """The spore op's arguments for a ``function`` call (module doc) it computes, else None."""
    args = _functional_args(node, function)
    if args is None or not _trains(node):
        return None
    x, eps = args["input"], args["eps"]
    x_value = value(x)
    if not isinstance(x_value, torch.Tensor) or x_value.dtype not in norms.FLOATS:
        return None
    if _changed_later(node.graph, x):  # the op would save x; eager's autograd saved its own
        return None
    if eps is None and function is F.rms_norm:  # nn.RMSNorm's default
        eps = _default_rms_eps(x_value.dtype)
    elif type(eps) is int:
        eps = float(eps)
    if x_value.dim() < 1 or not isinstance(eps, float) or not norms.usable_eps(eps):
        return None
    shape = args["normalized_shape"]  # a node when dynamo traced x.shape[-1:] symbolically
    if not isinstance(shape, (list, tuple)) or list(shape) != [x_value.shape[-1]]:
        return None
    params = [args["weight"], args.get("bias")]
    for param in params:
        found = value(param)
        if param is not None and not (
            isinstance(found, torch.Tensor)
            and tuple(found.shape) == (x_value.shape[-1],)
            and found.dtype == x_value.dtype
        ):
            return None
    if function is F.layer_norm:
        return x, *params, eps
    return x, params[0], eps


def _default_rms_eps(dtype: torch.dtype) -> float:
    """``F.rms_norm``'s epsilon for ``eps=None``: that of the dtype it computes in (float32 for
    16-bit inputs, not the input's own, whatever ``nn.RMSNorm``'s docs say)."""
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def _rewrite_functional(graph: Graph, function: Callable[..., Any], op: str) -> int:
    count = 0
    for node in list(graph.nodes):
        args = _functional_norm(node, function)
        if args is None:
            continue
        with graph.inserting_before(node):
            if op == "rms_norm" and args[1] is None:
                args = (args[0], norms.ones(graph, args[0]), args[2])
            new = norms.emit(graph, norms.spore_op(op), *args)
        norms.replace(graph, node, new, [node])
        count += 1
    return count


PASSES = (AddRMSNormTrainPass(), RMSNormTrainPass(), LayerNormTrainPass())
