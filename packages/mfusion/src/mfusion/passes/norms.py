"""RMSNorm, Add+RMSNorm, LayerNorm and Mean+Var: their post-grad forms rewritten into spore ops.

The passes walk the graph themselves (no traced patterns): a norm has many spellings (with or
without the float32 upcast, either operand order of every product, ``pow(x, 2)`` or ``x * x``,
the weight as given, upcast, or as Gemma's ``1 + w``, any epsilon), and a walk from the
``rsqrt`` node checks them all while reading epsilon as whatever float the model uses.

What is rewritten, and why it keeps the numerics:

- RMSNorm: ``x * rsqrt(mean(x*x, -1, keepdim) + eps)`` (or ``x / sqrt(...)``, which differs by
  an ulp at most; or with the weight multiplied in first, ``w * x * rsqrt(...)``) with the
  statistics and the product in
  float32 (float64 for float64 x), optionally times a weight of x's last-dimension shape, then
  rounded once to x's dtype (Gemma's order, and every float32 model) → ``spore.rms_norm``.
  Hugging Face Llama/Qwen2/Mistral/T5 round the normalised x to bfloat16/float16 before the
  weight product; Inductor compiles that cast as no rounding unless
  ``torch._inductor.config.emulate_precision_casts`` is set, so plain ``torch.compile``
  already computes the op's one-rounding result (measured: the same bits but for ulp-level
  reduction-order differences). The pass rewrites that form only while the flag is off and
  leaves it to Inductor when it is on (the exact alternative ``w * rms_norm(x, ones)`` was
  2x slower than Inductor's fused kernel). A bfloat16 Gemma norm (``(1 + w)`` in float32,
  which x's dtype cannot hold) is left alone: the CPU kernel needs the weight in x's dtype and
  the mixed-dtype reference was 6x slower than Inductor.
- Add+RMSNorm: the same norm of ``a + b`` (same shape and dtype) → ``spore.add_rms_norm``,
  whose second output replaces the sum wherever else it is used (the residual stream).
- LayerNorm: ``(x - mean) * rsqrt(var + eps)`` from one biased ``var_mean`` over the last
  dimension in float32, optionally ``* weight`` then ``+ bias`` in float32, rounded once →
  ``spore.layer_norm`` (the op's contract, and what ``F.layer_norm`` decomposes to); also
  the hand-written statistics, ``x.mean`` beside ``x.var(correction=0)`` or
  ``((x - mean)**2).mean`` (the op's own two-pass formula), and ``(x - mean) / sqrt(var +
  eps)`` (an ulp or two from the reciprocal root).
- Mean+Var: ``var_mean`` over one dimension, or ``mean`` and ``var`` of the same tensor over
  the same dimension → ``spore.mean_var`` (unsqueezed back for ``keepdim``); a ``var_mean``
  whose variance feeds ``rsqrt(var + eps)`` (a LayerNorm the LayerNorm pass could not take,
  e.g. in a training forward) stays with Inductor, which fuses it with the normalisation.

A form is left alone when an intermediate is used outside it (a training forward saves
``rsqrt`` for the backward; :mod:`mfusion.passes.norms_train` rewrites those norms before
autograd with this module's matcher), when dtypes, shapes or the reduced dimension differ from
what the op computes, or when a low-precision form computes its statistics without the
upcast. Epsilon must be a constant: under ``torch.compile(dynamic=True)`` dynamo passes a
module's float attribute (HF's ``variance_epsilon``) as a tensor input, and such an RMSNorm is
left alone; and one the ops take, finite and >= 0 (eager computes with a negative, NaN or
infinite one, where the ops raise).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_arg

import spore
from mfusion.passes._match import FLOATS, rounds_as_eager
from mfusion.passes._torch_ir import value

aten = torch.ops.aten
prims = torch.ops.prims

WIDER = {
    torch.bfloat16: (torch.float32, torch.float64),
    torch.float16: (torch.float32, torch.float64),
    torch.float32: (torch.float64,),
}
_ADD = (aten.add.Tensor, aten.add.Scalar)
_MUL = (aten.mul.Tensor,)
_CONVERT = (prims.convert_element_type.default,)
_BIAS = (aten.add.Tensor,)


# Graph reading ---------------------------------------------------------------------------


_val = value  # the fake tensor a node computes (meta "val" or dynamo's "example_value")


def _is(node: Any, *targets: Any) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _arg(node: Node, index: int, name: str, default: Any = None) -> Any:
    """An argument given by position or by keyword."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _dtype(node: Any) -> torch.dtype | None:
    value = _val(node)
    return value.dtype if isinstance(value, torch.Tensor) else None


def _shape(node: Any) -> tuple[int, ...] | None:
    value = _val(node)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def usable_eps(eps: float) -> bool:
    """Whether the spore norm ops take ``eps`` (a finite number >= 0, their own check): a
    negative, NaN or infinite epsilon, which eager and Inductor compute with, would make the
    rewritten graph raise, so such a norm is left alone."""
    from spore_kernels._checks import valid_eps

    return valid_eps(eps)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the spore norm ops compute in for inputs of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def source(node: Any) -> Any:
    """``node`` with exact upcasts (``convert_element_type`` to a wider float) stripped."""
    while _is(node, *_CONVERT) and _dtype(node) in WIDER.get(_dtype(node.args[0]), ()):
        node = node.args[0]
    return node


def _scalar(value: Any) -> float | None:
    """A Python number as float (not a bool, not a node), else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _tensor_and_scalar(node: Node) -> tuple[Node, float] | None:
    """``(t, c)`` for ``t + c`` or ``c + t`` with a constant ``c`` (alpha 1 only)."""
    if not _is(node, *_ADD) or node.kwargs.get("alpha", 1) != 1 or len(node.args) != 2:
        return None
    a, b = node.args
    if isinstance(a, Node) and _scalar(b) is not None:
        return a, _scalar(b)  # type: ignore[return-value]
    if isinstance(b, Node) and _scalar(a) is not None:
        return b, _scalar(a)  # type: ignore[return-value]
    return None


def _other(node: Node, one: Node) -> Any:
    """The other operand of a binary node that has ``one`` as an operand."""
    a, b = node.args[:2]
    return b if a is one else a


def _only_user(node: Node) -> Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _single_last_dim(dims: Any, rank: int) -> bool:
    if rank < 1:  # a 0-d tensor: mean(-1) is legal there, but no op takes it
        return False
    return isinstance(dims, (list, tuple)) and len(dims) == 1 and dims[0] in (-1, rank - 1)


def _rank(node: Any) -> int:
    shape = _shape(node)
    return -1 if shape is None else len(shape)


def _follow(node: Node, width: int, targets: tuple[Any, ...]) -> tuple[Node, Node] | None:
    """``(result, other)`` when ``node``'s only user is ``node <op> other`` for an op among
    ``targets`` (alpha 1), with ``other`` of shape ``(width,)`` and the result shaped like
    ``node``: a weight product (``_MUL``) or a bias sum (``_BIAS``)."""
    user = _only_user(node)
    if user is None or not _is(user, *targets) or len(user.args) != 2:
        return None
    if user.kwargs.get("alpha", 1) != 1:
        return None
    other = _other(user, node)
    if _shape(other) != (width,) or _shape(user) != _shape(node):
        return None
    return user, other


def _multiplied(node: Node) -> bool:
    """Whether ``node``'s only user multiplies it by a tensor (a weight the op cannot take)."""
    user = _only_user(node)
    return _is(user, *_MUL) and isinstance(_other(user, node), Node)


def _follow_convert(node: Node, dtype: torch.dtype) -> Node | None:
    """``node``'s only user when it casts ``node`` to ``dtype``."""
    user = _only_user(node)
    if _is(user, *_CONVERT) and _dtype(user) == dtype:
        return user
    return None


# Graph writing ---------------------------------------------------------------------------


def emit(
    graph: Graph, target: Callable[..., Any], *args: Any, like: Node | None = None, **kwargs: Any
) -> Node:
    """A new call node with its fake value computed from its inputs' fake values (in the fake
    mode of ``like``'s value for a node without inputs); none when they are not all fake
    tensors of one mode. It goes where the graph keeps values: ``meta["val"]``, or
    ``meta["example_value"]`` in dynamo's (pre-grad) graph."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._pytree import tree_leaves

    node = graph.call_function(target, args, kwargs)
    inputs = node.all_input_nodes + ([like] if like is not None else [])
    values = [_val(a) for a in inputs]
    leaves = [v for v in tree_leaves(values) if isinstance(v, torch.Tensor)]
    modes = {v.fake_mode for v in leaves if isinstance(v, FakeTensor)}
    if None not in values and len(modes) == 1 and all(isinstance(v, FakeTensor) for v in leaves):
        dynamo = all("val" not in a.meta for a in inputs)
        with modes.pop():
            result = target(*map_arg(args, _val), **map_arg(kwargs, _val))
        node.meta["example_value" if dynamo else "val"] = result
    return node


def spore_op(name: str) -> Any:
    """``torch.ops.spore.<name>.default`` (importing spore_kernels defines the ops)."""
    import spore_kernels  # noqa: F401

    return getattr(torch.ops.spore, name).default


def ones(graph: Graph, like: Node) -> Node:
    """A ``(last dimension,)`` tensor of ones in ``like``'s dtype and device."""
    value = _val(like)
    size = value.shape[-1]
    if not isinstance(size, int):  # symbolic (mark_dynamic): read off ``like`` at run time
        size = emit(graph, aten.sym_size.int, like, -1)
    return emit(
        graph,
        aten.full.default,
        [size],
        1.0,
        dtype=value.dtype,
        layout=torch.strided,
        device=value.device,
        pin_memory=False,
        like=like,
    )


def _erase_dead(graph: Graph, nodes: Iterable[Node]) -> None:
    """Erase those of ``nodes`` (and then their dead inputs among them) left without users."""
    pending = [n for n in dict.fromkeys(nodes) if n.graph is graph]
    changed = True
    while changed:
        changed = False
        for node in list(pending):
            if not node.users:
                graph.erase_node(node)
                pending.remove(node)
                changed = True


def _position(graph: Graph) -> dict[Node, int]:
    return {node: i for i, node in enumerate(graph.nodes)}


# RMSNorm ---------------------------------------------------------------------------------


@dataclass
class RMSNormMatch:
    """One RMSNorm found in a graph: what the op needs and which nodes it replaces."""

    x: Node
    weight: Node | None
    eps: float
    out: Node
    upcast: Node
    inner: list[Node] = field(default_factory=list)


def _normalising(root: Node) -> tuple[Node, Any, bool] | None:
    """``(normed, operand, divided)`` when ``root`` is an ``rsqrt`` whose only user is
    ``operand * root`` (either order), or a ``sqrt`` whose only user is ``operand / root``
    (``divided``): the normalising step of an RMSNorm or a LayerNorm."""
    divided = _is(root, aten.sqrt.default)
    if not (divided or _is(root, aten.rsqrt.default)):
        return None
    normed = _only_user(root)
    if normed is None:
        return None
    if divided:
        if not _is(normed, aten.div.Tensor) or normed.args[1] is not root or normed.kwargs:
            return None
        return normed, normed.args[0], True
    if not _is(normed, *_MUL) or len(normed.args) != 2:
        return None
    return normed, _other(normed, root), False


def match_rms_norm(rsqrt: Node) -> RMSNormMatch | None:
    """The RMSNorm whose ``rsqrt`` (or ``sqrt``, for ``x / sqrt(...)``) node is ``rsqrt``, if
    the op computes it (module doc)."""
    normalising = _normalising(rsqrt)
    if normalising is None:
        return None
    normed, scaled, divided = normalising
    found = _tensor_and_scalar(rsqrt.args[0])
    if found is None:
        return None
    mean, eps = found
    if not usable_eps(eps):
        return None
    if not _is(mean, aten.mean.dim) or mean.kwargs.get("dtype") is not None:
        return None
    squared = mean.args[0]
    if not _arg(mean, 2, "keepdim", False) or not _single_last_dim(mean.args[1], _rank(squared)):
        return None
    if not _is_square(squared):
        return None
    xf = squared.args[0]
    x = source(xf)
    dtype = _dtype(x)
    if dtype not in FLOATS or _dtype(xf) != compute_dtype(dtype):
        return None
    chain = [squared, mean, rsqrt.args[0], rsqrt]
    if any(_only_user(n) is None for n in chain[:-1]):
        return None
    if _dtype(normed) != _dtype(xf) or _shape(normed) != _shape(x):
        return None
    if source(scaled) is x:
        return _rms_tail(x, xf, normed, eps, [*chain, normed])
    weighted = _weighted(scaled, x)
    if weighted is None or divided or _dtype(weighted) != dtype or _dtype(scaled) != _dtype(xf):
        return None
    return _rms_tail(x, xf, normed, eps, [*chain, scaled, normed], weight=weighted)


def _weighted(product: Any, x: Node) -> Node | None:
    """The weight ``w`` (upcasts stripped) when ``product`` is ``x * w`` or ``w * x`` (x
    upcast or not) with ``w`` of shape ``(last dimension,)``, used only by the norm."""
    if not _is(product, *_MUL) or len(product.args) != 2 or _only_user(product) is None:
        return None
    width = _shape(x)[-1]  # type: ignore[index]
    for mine, other in (product.args, reversed(product.args)):
        if source(mine) is x and _shape(other) == (width,) and _dtype(product) == _dtype(mine):
            return source(other)
    return None


def _is_square(node: Node) -> bool:
    """``pow(t, 2)`` or ``t * t``."""
    if _is(node, aten.pow.Tensor_Scalar):
        return _scalar(node.args[1]) == 2.0
    return _is(node, *_MUL) and node.args[0] is node.args[1]


def _rms_tail(
    x: Node, xf: Node, normed: Node, eps: float, inner: list[Node], weight: Node | None = None
) -> RMSNormMatch | None:
    """The weight product (unless ``weight`` was multiplied in before the ``rsqrt``) and final
    cast after the normalised x (module doc for the forms)."""
    dtype, width = _dtype(x), _shape(x)[-1]  # type: ignore[index]
    end = normed
    scaled = None if weight is not None else _follow(normed, width, _MUL)
    if scaled is not None and _dtype(scaled[0]) == _dtype(normed):
        weight = source(scaled[1])
        if _dtype(weight) != dtype:
            return None  # e.g. Gemma's float32 (1 + w) for bfloat16 x: left alone
        end = scaled[0]
        inner.append(end)
    if dtype == compute_dtype(dtype):
        if weight is None and _multiplied(end):
            return None  # a weight of another shape: the op cannot take it
        return RMSNormMatch(x, weight, eps, end, xf, inner)
    cast = _follow_convert(end, dtype)
    if cast is None:
        return None
    if weight is not None:
        return RMSNormMatch(x, weight, eps, cast, xf, [*inner, cast])
    llama = _follow(cast, width, _MUL)
    if llama is not None and _dtype(llama[0]) == dtype:
        if _dtype(llama[1]) != dtype or rounds_as_eager(_val(x)):
            return None
        return RMSNormMatch(x, llama[1], eps, llama[0], xf, [*inner, cast, llama[0]])
    if _multiplied(cast) or _multiplied(end):
        return None
    return RMSNormMatch(x, None, eps, cast, xf, [*inner, cast])


def rms_norms(graph: Graph) -> Iterator[RMSNormMatch]:
    """The RMSNorms of ``graph``, each matched when reached: a rewrite of one before it (whose
    output may be its x) is seen."""
    for node in list(graph.nodes):
        match = match_rms_norm(node)
        if match is not None:
            yield match


def replace(graph: Graph, old: Node, new: Node, inner: Sequence[Node]) -> None:
    """``new`` takes ``old``'s users; then ``inner`` nodes left without users are erased."""
    old.replace_all_uses_with(new)
    new.meta.setdefault("stack_trace", old.meta.get("stack_trace"))
    _erase_dead(graph, reversed(list(inner)))


def plain_add(node: Node) -> bool:
    """Whether ``node`` is ``a + b`` (alpha 1) of two tensors of its shape and dtype."""
    if not _is(node, aten.add.Tensor) or node.kwargs.get("alpha", 1) != 1:
        return False
    shape, dtype = _shape(node), _dtype(node)
    return all(
        isinstance(t, Node) and _shape(t) == shape and _dtype(t) == dtype for t in node.args[:2]
    )


def add_rms_norm_anchor(graph: Graph, match: RMSNormMatch) -> Node | None:
    """The node after which ``spore.add_rms_norm`` of ``match`` (whose x is the sum) goes: the
    sum, or the weight when that comes later (Gemma's ``1 + w``); None when a node outside the
    norm uses the sum before the weight, or the weight is computed from it, or when there is
    no weight and the row's length is symbolic (its ones would read the size off the sum,
    which the op replaces)."""
    added, weight = match.x, match.weight
    if weight is None and not isinstance(_val(added).shape[-1], int):
        return None
    position = _position(graph)
    if weight is None or position[weight] < position[added]:
        return added
    own = set(match.inner)  # erased by the rewrite, and the upcast with them if only they use it
    if set(match.upcast.users) <= own:
        own.add(match.upcast)
    kept = [u for u in added.users if u not in own]
    if any(position[u] < position[weight] for u in kept) or _reads(weight, added):
        return None
    return weight


def _reads(node: Node, earlier: Node) -> bool:
    """Whether ``node``'s value is computed from ``earlier``'s (through any of its inputs)."""
    seen, todo = {node}, [node]
    while todo:
        for arg in todo.pop().all_input_nodes:
            if arg is earlier:
                return True
            if arg not in seen:
                seen.add(arg)
                todo.append(arg)
    return False


def rewrite_add_rms_norm(graph: Graph, match: RMSNormMatch, anchor: Node) -> dict[Node, Node]:
    """Replace ``match`` (the RMSNorm of a plain ``a + b``) by ``spore.add_rms_norm`` after
    ``anchor``; the op's sum replaces ``a + b`` wherever else it is used. Returns the nodes
    replaced → their replacements."""
    added = match.x
    with graph.inserting_before(anchor.next):
        weight = match.weight if match.weight is not None else ones(graph, added)
        a, b = added.args[:2]
        fused = emit(graph, spore_op("add_rms_norm"), a, b, weight, match.eps)
        normed = emit(graph, operator.getitem, fused, 0)
        total = emit(graph, operator.getitem, fused, 1)
    replace(graph, match.out, normed, match.inner)
    added.replace_all_uses_with(total)
    _erase_dead(graph, [match.upcast, added])
    return {match.out: normed, added: total}


def rewrite_rms_norm(graph: Graph, match: RMSNormMatch) -> dict[Node, Node]:
    """Replace ``match`` by ``spore.rms_norm`` (a weight of ones when it has none); returns
    ``{match.out: the op's node}``."""
    with graph.inserting_before(match.out):
        weight = match.weight if match.weight is not None else ones(graph, match.x)
        new = emit(graph, spore_op("rms_norm"), match.x, weight, match.eps)
    replace(graph, match.out, new, [*match.inner, match.upcast])
    return {match.out: new}


class AddRMSNormPass(spore.GraphPass):
    """``rms_norm(a + b)`` → ``spore.add_rms_norm(a, b, w, eps)``; its sum feeds other users."""

    name = "add_rms_norm"
    version = "5"
    on_cpu = False  # Inductor's fused C++ kernel is as fast; the op call costs more
    priority = 30
    summary = "residual add + RMSNorm → spore.add_rms_norm (the sum stays available)"

    def __call__(self, gm: GraphModule) -> int:
        graph, count = gm.graph, 0
        for match in rms_norms(graph):
            anchor = add_rms_norm_anchor(graph, match) if plain_add(match.x) else None
            if anchor is not None:
                rewrite_add_rms_norm(graph, match, anchor)
                count += 1
        return count


class RMSNormPass(spore.GraphPass):
    """Every RMSNorm form the op computes → ``spore.rms_norm(x, w, eps)``."""

    name = "rms_norm"
    version = "3"
    on_cpu = False  # Inductor's fused C++ kernel is as fast; the op call costs more
    priority = 25
    summary = "RMSNorm (Llama/Qwen2/Mistral/T5/Gemma forms, any eps) → spore.rms_norm"

    def __call__(self, gm: GraphModule) -> int:
        count = 0
        for match in rms_norms(gm.graph):
            rewrite_rms_norm(gm.graph, match)
            count += 1
        return count


# LayerNorm -------------------------------------------------------------------------------


def _var_mean_parts(node: Node) -> tuple[Node, Node] | None:
    """``(var, mean)`` getitem nodes of a ``var_mean`` used only through both of them."""
    items = {u.args[1]: u for u in node.users if _is(u, operator.getitem)}
    if len(items) != 2 or len(node.users) != 2:
        return None
    return items[0], items[1]


class LayerNormPass(spore.GraphPass):
    """``F.layer_norm`` over the last dimension (weight and bias optional) → spore.layer_norm."""

    name = "layer_norm"
    version = "4"
    on_cpu = False  # Inductor's fused C++ kernel is as fast; the op call costs more
    priority = 25
    summary = "LayerNorm (F.layer_norm or hand-written, weight/bias optional) → spore.layer_norm"

    def __call__(self, gm: GraphModule) -> int:
        graph, count = gm.graph, 0
        for node in list(graph.nodes):
            found = self.match(node)
            if found is None:
                continue
            x, weight, bias, eps, out, inner = found
            with graph.inserting_before(out):
                new = emit(graph, spore_op("layer_norm"), x, weight, bias, eps)
            replace(graph, out, new, inner)
            count += 1
        return count

    @staticmethod
    def match(root: Node) -> tuple[Node, Node | None, Node | None, float, Node, list] | None:
        """``(x, weight, bias, eps, out, inner nodes)`` of the LayerNorm whose ``rsqrt`` (or
        the ``sqrt`` it divides by) is ``root``."""
        normalising = _normalising(root)
        if normalising is None or _only_user(root.args[0]) is None:
            return None
        normed, centred, _ = normalising
        found = _tensor_and_scalar(root.args[0])
        if found is None or _only_user(found[0]) is None:
            return None
        var, eps = found
        if not usable_eps(eps):
            return None
        if not _is(centred, aten.sub.Tensor) or centred.kwargs.get("alpha", 1) != 1:
            return None
        xf, mean = centred.args
        x = source(xf)
        dtype = _dtype(x)
        if dtype not in FLOATS or _dtype(xf) != compute_dtype(dtype) or not isinstance(mean, Node):
            return None
        stats = _layer_norm_statistics(var, xf, mean, centred)
        if stats is None or _dtype(normed) != _dtype(xf) or _shape(normed) != _shape(x):
            return None
        if set(centred.users) - {normed, *stats}:
            return None
        inner = [*stats, var, root.args[0], root, centred, normed, xf]
        end, width, params = normed, _shape(x)[-1], {}  # type: ignore[index]
        for name, targets in (("weight", _MUL), ("bias", _BIAS)):
            step = _follow(end, width, targets)
            if step is not None and _dtype(step[0]) == _dtype(xf):
                params[name] = source(step[1])
                if _dtype(params[name]) != dtype:
                    return None
                end = step[0]
                inner.append(end)
        if dtype != compute_dtype(dtype):
            end = _follow_convert(end, dtype)
            if end is None:
                return None
            inner.append(end)
        return x, params.get("weight"), params.get("bias"), eps, end, inner


def _same_upcast(node: Any, of: Node) -> bool:
    """Whether ``node`` holds ``of``'s values: ``of`` itself, or another exact upcast of the same
    tensor to the same dtype (``x.float()`` written twice)."""
    return node is of or (source(node) is source(of) and _dtype(node) == _dtype(of))


def _last_dim_mean(node: Any, of: Node) -> bool:
    """Whether ``node`` is ``of.mean(-1, keepdim=True)`` (no dtype argument)."""
    if (
        not _is(node, aten.mean.dim)
        or not _same_upcast(node.args[0], of)
        or node.kwargs.get("dtype")
    ):
        return False
    return bool(_arg(node, 2, "keepdim", False)) and _single_last_dim(node.args[1], _rank(of))


def _layer_norm_statistics(var: Node, xf: Node, mean: Node, centred: Node) -> list[Node] | None:
    """The nodes computing ``mean`` and ``var``, when they are the mean and the biased variance
    of ``xf`` over its last dimension (keepdim) used only by the LayerNorm whose centred x is
    ``centred`` (``xf - mean``): one ``var_mean(correction=0)``, ``xf.mean`` beside
    ``xf.var(correction=0)``, or ``((xf - mean)**2).mean``, that difference being ``centred``
    or a second ``xf - mean``; each may read its own upcast of x (:func:`_same_upcast`)."""
    if _is(var, operator.getitem) and _is(var.args[0], aten.var_mean.correction):
        stats = var.args[0]
        parts = _var_mean_parts(stats)
        if parts is None or parts != (var, mean) or not _same_upcast(stats.args[0], xf):
            return None
        if not _single_last_dim(_arg(stats, 1, "dim"), _rank(xf)):
            return None
        if _correction(stats) != 0 or not stats.kwargs.get("keepdim", False):
            return None
        return [stats.args[0], stats, mean] if list(mean.users) == [centred] else None
    if not _last_dim_mean(mean, xf):
        return None
    if _is(var, aten.var.correction):
        if not _same_upcast(var.args[0], xf) or not _single_last_dim(
            _arg(var, 1, "dim"), _rank(xf)
        ):
            return None
        if _correction(var) != 0 or not var.kwargs.get("keepdim", False):
            return None
        return [var.args[0], mean.args[0], mean] if list(mean.users) == [centred] else None
    if not _is(var, aten.mean.dim) or not _last_dim_mean(var, var.args[0]):
        return None
    if not _is_square(var.args[0]):
        return None
    squared = var.args[0]
    deviation = squared.args[0]
    if _only_user(squared) is not var or not _is(deviation, aten.sub.Tensor):
        return None
    if not _same_upcast(deviation.args[0], xf) or deviation.args[1] is not mean:
        return None
    if len(deviation.args) != 2 or deviation.kwargs.get("alpha", 1) != 1:
        return None
    if set(mean.users) != {centred, deviation}:
        return None
    if deviation is not centred and _only_user(deviation) is not squared:
        return None
    return [mean.args[0], deviation.args[0], mean, deviation, squared]


# Mean+Var --------------------------------------------------------------------------------


def _one_dim(dims: Any, rank: int) -> int | None:
    """The single reduced dimension, made non-negative, or None."""
    if not isinstance(dims, (list, tuple)) or len(dims) != 1 or not isinstance(dims[0], int):
        return None
    return dims[0] % rank if -rank <= dims[0] < rank else None


def _correction(node: Node) -> int | None:
    """A ``var``/``var_mean`` node's correction as a non-negative int (None means 1)."""
    value = node.kwargs.get("correction", 1)
    value = 1 if value is None else _scalar(value)
    if value is None or value < 0 or value != int(value):
        return None
    return int(value)


def _feeds_rsqrt(var: Node) -> bool:
    """Whether ``var`` is used as ``rsqrt(var + eps)``."""
    return any(
        _tensor_and_scalar(u) is not None and any(_is(r, aten.rsqrt.default) for r in u.users)
        for u in var.users
    )


class MeanVarPass(spore.GraphPass):
    """``var_mean`` or ``mean`` + ``var`` of one tensor over one dimension → spore.mean_var."""

    name = "mean_var"
    version = "1"
    priority = 5
    summary = "var_mean, or mean and var of one tensor over one dim → spore.mean_var"

    def __call__(self, gm: GraphModule) -> int:
        graph, count = gm.graph, 0
        for node in list(graph.nodes):
            if node.graph is not graph:
                continue
            if _is(node, aten.var_mean.correction):
                count += self._var_mean(graph, node)
            elif _is(node, aten.var.correction):
                count += self._two_pass(graph, node)
        return count

    @staticmethod
    def _spec(node: Node) -> tuple[Node, int, int, bool] | None:
        """``(x, dim, correction, keepdim)`` of a var/var_mean node the op computes."""
        x = node.args[0]
        rank, dtype = _rank(x), _dtype(x)
        dim = _one_dim(_arg(node, 1, "dim"), rank)
        correction = _correction(node)
        if dtype not in FLOATS or dim is None or correction is None:
            return None
        return x, dim, correction, bool(node.kwargs.get("keepdim", False))

    def _emit_pair(
        self, graph: Graph, before: Node, spec: tuple[Node, int, int, bool]
    ) -> tuple[Node, Node]:
        x, dim, correction, keepdim = spec
        with graph.inserting_before(before):
            fused = emit(graph, spore_op("mean_var"), x, dim, correction)
            pair = [emit(graph, operator.getitem, fused, i) for i in (0, 1)]
            if keepdim:
                pair = [emit(graph, aten.unsqueeze.default, p, dim) for p in pair]
        return pair[0], pair[1]

    def _var_mean(self, graph: Graph, node: Node) -> int:
        spec = self._spec(node)
        if spec is None or any(not _is(u, operator.getitem) for u in node.users):
            return 0
        if any(_feeds_rsqrt(u) for u in node.users if u.args[1] == 0):
            return 0  # a LayerNorm's statistics: Inductor fuses them with the normalisation
        mean, var = self._emit_pair(graph, node, spec)
        for item in list(node.users):
            item.replace_all_uses_with(var if item.args[1] == 0 else mean)
            graph.erase_node(item)
        graph.erase_node(node)
        return 1

    def _two_pass(self, graph: Graph, var: Node) -> int:
        spec = self._spec(var)
        if spec is None:
            return 0
        x, dim, _, keepdim = spec
        for mean in x.users:
            if not _is(mean, aten.mean.dim) or mean.kwargs.get("dtype") is not None:
                continue
            if _dtype(mean) != _dtype(x) or _one_dim(mean.args[1], _rank(x)) != dim:
                continue
            if bool(_arg(mean, 2, "keepdim", False)) != keepdim:
                continue
            position = _position(graph)
            first = min(mean, var, key=position.__getitem__)
            new_mean, new_var = self._emit_pair(graph, first, spec)
            replace(graph, mean, new_mean, [mean])
            replace(graph, var, new_var, [var])
            return 1
        return 0


PASSES = (AddRMSNormPass(), RMSNormPass(), LayerNormPass(), MeanVarPass())
