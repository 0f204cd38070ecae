"""Matmul rewrites on post-grad aten graphs: reshape+bias, transpose, batch-1/broadcast BMM, K = 1
and cast absorption.

Each pass is a :class:`spore.GraphPass` that walks the graph, checks the fake tensors in
``node.meta["val"]`` (dtypes, shapes, strides; sizes only where statically known, so no pass
adds a guard) and rewrites only forms that compute the same function: the values may differ by
the GEMM's summation order, and ``mm_reshape_bias`` adds the bias inside the GEMM (one rounding
in bf16/fp16 instead of two, as Inductor's own 2-D ``mm + bias → addmm`` and eager ``F.linear``
do). Running a pass twice changes nothing more.

Which are registered (``PASSES``), and where, follows a side-by-side measurement against plain
Inductor on the 2-core AVX2 CPU under load: [2048, 1024] x [1024, 1024] fp32 and [512, 1024] x
[1024, 1024] bf16 (bf16 GEMMs take up to 40 s at M = 2048 there), median speed-up of 15 (fp32)
or 9 (bf16) interleaved rounds, two runs each; a graph timed against itself spans 0.80-2.1:

- ``mm_reshape_bias``: fp32 1.01 / 1.12, bf16 0.99 / 1.01 (same GEMM, the bias pass goes);
- ``mm_transpose``: fp32 1.05 / 1.06 (right operand), 1.07 / 1.04 (left); bf16 1.00 / 1.00
  and 1.00 / 0.95: fp32/fp64 only;
- ``bmm_to_mm``: batch 1 fp32 1.08 / 1.04 / 0.995, bf16 0.96 / 0.98 (fp32/fp64 only);
  broadcast fp32 1.05 / 0.93 / 1.00 (the 0.93 run beside a compile), bf16 1.03 / 1.12: the
  same GEMM, kept as a step that lets ``mm_reshape_bias`` and Inductor's mm rules see it;
- ``mm_k1`` with a pointwise user: fp32 1.30 / 1.09, bf16 5.0 / 1.30; a lone K = 1 ``mm`` is
  faster in BLAS (the multiply measured 0.33), so only an ``mm`` whose users are pointwise;
- ``mm_cast``: 0.45 / 0.45 (bf16 GEMM vs fp32 GEMM on AVX2): not registered.

A plain ``mm + 1-D bias`` needs no pass: Inductor's post-grad ``addmm`` pattern already makes it
one ``addmm`` on CPU (any dtype, when bias and operands share it), and turning an ``addmm`` with
a pointwise user back into ``mm + add`` for fusion measured fp32 0.94 / 1.01, bf16 1.09 / 1.06
(noise-level): not built.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch.fx import Graph, GraphModule, Node

import spore
from mfusion.passes._match import NARROW_FLOATS

aten = torch.ops.aten
prims = torch.ops.prims

#: dtypes whose CPU GEMM speed does not hinge on the operands' layout. Without native bf16/fp16
#: GEMM, [512, 1024] x [1024, 1024] bf16 takes 0.1 s to 2.3 s by layout alone, so passes that
#: change an operand's layout or the GEMM entry point (mm_transpose, batch-1 bmm_to_mm) keep to
#: these, where they measured at least as fast.
LAYOUT_SAFE = (torch.float32, torch.float64)
#: ops that reshape an ``mm`` result without moving its elements (what ``matmul`` leaves around it)
RESHAPES = (aten.view.default, aten.reshape.default, aten.unsqueeze.default)


def _val(node: Any) -> torch.Tensor | None:
    """The (fake) tensor a node produces, or ``None`` for non-tensors and nodes without one."""
    if not isinstance(node, Node):
        return None
    value = node.meta.get("val")
    return value if isinstance(value, torch.Tensor) else None


def _same(a: Any, b: Any) -> bool:
    """Whether two sizes/strides (ints or SymInts) or tuples of them are known equal; never
    guards (a post-grad pass cannot add guards)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if isinstance(a, (tuple, list, torch.Size)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(statically_known_true(a == b))


def _is_call(node: Any, *targets: Any) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _only_user(node: Node, user: Node) -> bool:
    return list(node.users) == [user]


def _new_node(graph: Graph, target: Any, args: Sequence[Any]) -> Node:
    """``target(*args)`` as a node, with ``meta["val"]`` computed on the arguments' fake values
    (tensors and, in dynamic-shape graphs, the SymInts of size nodes)."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    values = [_val(a) for a in args if isinstance(a, Node)]
    mode = detect_fake_mode(values) or FakeTensorMode(allow_non_fake_inputs=True)

    def fake(a: Node) -> Any:
        if "val" not in a.meta:
            raise ValueError(f"mfusion matmul: node {a.name} has no meta['val'] to rewrite with")
        value = a.meta["val"]
        if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
            return mode.from_tensor(value)
        return value

    node = graph.call_function(target, tuple(args))
    with mode:
        node.meta["val"] = target(*torch.fx.node.map_arg(tuple(args), fake))
    return node


def _prune(graph: Graph, nodes: Sequence[Node]) -> None:
    """Erase those of ``nodes`` (consumers first; repeats count once) that lost every user."""
    for node in dict.fromkeys(nodes):
        if not node.users:
            graph.erase_node(node)


def _replace(graph: Graph, old: Node, new: Node, matched: Sequence[Node] = ()) -> None:
    """Point ``old``'s users at ``new``; erase ``old`` and the ``matched`` nodes left unused."""
    old.replace_all_uses_with(new)
    new.meta.setdefault("stack_trace", old.meta.get("stack_trace"))
    _prune(graph, [old, *matched])


def _row_bias(bias: Any, out: torch.Tensor) -> bool:
    """Whether ``bias`` is a 1-D tensor of the output's column count and dtype (added per row)."""
    value = _val(bias)
    return (
        value is not None
        and value.dim() == 1
        and _same(value.shape[0], out.shape[-1])
        and value.dtype == out.dtype
        and value.device == out.device
    )


def _split_add(add: Node, wanted: Any) -> tuple[Node, Any] | None:
    """``(producer, other)`` when one operand of ``add`` is a node that ``wanted(node)`` accepts."""
    for side in (0, 1):
        candidate, other = add.args[side], add.args[1 - side]
        if isinstance(candidate, Node) and wanted(candidate):
            return candidate, other
    return None


class _MatmulPass(spore.GraphPass):
    """Shared walk: :meth:`rewrite` is tried on every call of one of ``targets``, in graph order;
    it may erase only that node and nodes before it. Returns the count of rewrites."""

    priority = 0
    summary = ""
    targets: ClassVar[tuple[Any, ...]] = ()

    def rewrite(self, graph: Graph, node: Node) -> bool:
        raise NotImplementedError

    def __call__(self, gm: GraphModule) -> int:
        graph = gm.graph
        count = 0
        for node in list(graph.nodes):
            if _is_call(node, *self.targets) and self.rewrite(graph, node):
                count += 1
        return count


class MmReshapeBias(_MatmulPass):
    """``view(mm(a, b), shape) + bias`` → ``view(addmm(bias, a, b), shape)`` (also ``reshape``,
    and ``unsqueeze`` as ``bmm_to_mm`` leaves it).

    What ``x @ w + b`` on an N-D ``x`` becomes post-grad; the view must keep the last dimension.
    Inductor itself turns the 2-D ``mm + bias`` into ``addmm`` (bias, operands and result of one
    dtype); this pass extends that to the reshaped form under the same dtype rule, so the result
    is what Inductor gives for the 2-D form and what eager ``F.linear`` computes.
    """

    name = "mm_reshape_bias"
    version = "2"
    priority = 20
    summary = "view(mm) + 1-D bias → view(addmm) (x @ w + b on N-D x)"
    targets = (aten.add.Tensor,)

    def rewrite(self, graph: Graph, node: Node) -> bool:
        if node.kwargs.get("alpha", 1) != 1 or len(node.args) != 2:  # not a plain a + b
            return False

        def reshaped_mm(n: Node) -> bool:
            return (
                _is_call(n, *RESHAPES)
                and _only_user(n, node)
                and _is_call(n.args[0], aten.mm.default)
                and _only_user(n.args[0], n)
            )

        found = _split_add(node, reshaped_mm)
        if found is None:
            return False
        view, bias = found
        mm = view.args[0]
        out, view_out, mm_out = _val(node), _val(view), _val(mm)
        if out is None or view_out is None or mm_out is None:
            return False
        if not mm_out.dtype.is_floating_point or not _row_bias(bias, mm_out):
            return False
        if not _same(view_out.shape[-1], mm_out.shape[-1]) or out.dtype != mm_out.dtype:
            return False
        if not _same(out.shape, view_out.shape):
            return False
        with graph.inserting_before(node):
            addmm = _new_node(graph, aten.addmm.default, (bias, *mm.args))
            reshaped = _new_node(graph, view.target, (addmm, *view.args[1:]))
        _replace(graph, node, reshaped, [view, mm])
        return True


def _materialised_transpose(node: Any, user: Node, dims: list[int]) -> Node | None:
    """The ``permute`` under ``clone(permute(x, dims))`` when ``user`` is the clone's only user
    (any memory format: the copy holds the same values)."""
    if not (_is_call(node, aten.clone.default) and _only_user(node, user)):
        return None
    permute = node.args[0]
    if not _is_call(permute, aten.permute.default) or list(permute.args[1]) != dims:
        return None
    value = _val(permute)
    # GEMM reads an operand in place when one of its two inner strides is 1
    if value is None or not any(_same(stride, 1) for stride in value.stride()[-2:]):
        return None
    return permute


class MmTranspose(_MatmulPass):
    """``mm(clone(permute(x, [1, 0])), ...)`` → ``mm(permute(x, [1, 0]), ...)`` (either operand;
    also ``addmm`` and ``bmm`` with ``[0, 2, 1]``): BLAS reads a transposed operand as it is.
    fp32/fp64 only (see ``LAYOUT_SAFE``)."""

    name = "mm_transpose"
    version = "3"
    priority = 25
    summary = "drop a contiguous copy of a transpose that only feeds mm/addmm/bmm"

    OPERANDS: ClassVar[dict[Any, tuple[tuple[int, int], list[int]]]] = {
        aten.mm.default: ((0, 1), [1, 0]),
        aten.addmm.default: ((1, 2), [1, 0]),
        aten.bmm.default: ((0, 1), [0, 2, 1]),
    }
    targets = tuple(OPERANDS)

    def rewrite(self, graph: Graph, node: Node) -> bool:
        out = _val(node)
        if out is None or out.dtype not in LAYOUT_SAFE:
            return False
        positions, dims = self.OPERANDS[node.target]
        args = list(node.args)
        dropped = []
        for i in positions:
            permute = _materialised_transpose(args[i], node, dims)
            if permute is not None:
                dropped.append(args[i])
                args[i] = permute
        if not dropped:
            return False
        node.args = tuple(args)
        _prune(graph, dropped)
        return True


def _static(*sizes: Any) -> bool:
    return all(isinstance(size, int) for size in sizes)


class BmmToMm(_MatmulPass):
    """``bmm(a, b)`` where ``b`` is one matrix for every batch → one ``mm``: batch 1 becomes
    ``unsqueeze(mm(squeeze(a), squeeze(b)))`` (fp32/fp64 only, see ``LAYOUT_SAFE``: the same
    GEMM through another entry point); a right operand expanded over the batch (stride 0)
    becomes ``view(mm(view(a, [B * M, K]), b[0]), [B, M, N])`` in any float dtype when ``a``
    folds by a view (static shapes only: the views need fixed sizes): B small GEMMs become one
    tall one."""

    name = "bmm_to_mm"
    version = "3"
    priority = 40
    summary = "bmm of batch 1 or with a batch-broadcast right operand → one mm with views"
    targets = (aten.bmm.default,)

    def rewrite(self, graph: Graph, node: Node) -> bool:
        left, right = node.args
        a, b, out = _val(left), _val(right), _val(node)
        if a is None or b is None or out is None:
            return False
        if _same(a.shape[0], 1) and out.dtype in LAYOUT_SAFE:
            with graph.inserting_before(node):
                squeezed = [_new_node(graph, aten.squeeze.dim, (x, 0)) for x in (left, right)]
                mm = _new_node(graph, aten.mm.default, tuple(squeezed))
                result = _new_node(graph, aten.unsqueeze.default, (mm, 0))
        elif self._broadcast_right(a, b):
            batch, rows, cols = a.shape
            with graph.inserting_before(node):
                folded = _new_node(graph, aten.view.default, (left, [batch * rows, cols]))
                matrix = _new_node(graph, aten.select.int, (right, 0, 0))
                mm = _new_node(graph, aten.mm.default, (folded, matrix))
                result = _new_node(graph, aten.view.default, (mm, list(out.shape)))
        else:
            return False
        _replace(graph, node, result)
        return True

    @staticmethod
    def _broadcast_right(a: torch.Tensor, b: torch.Tensor) -> bool:
        """``b`` is stride 0 over a batch of one or more (its matrix is ``b[0]``) and ``a``
        ([B, M, K]) folds to [B * M, K] by a view."""
        if not (_static(*a.shape, *a.stride(), *b.shape) and b.stride(0) == 0 and b.shape[0]):
            return False
        return a.shape[1] == 1 or a.stride(0) == a.shape[1] * a.stride(1)


def _feeds_only_pointwise(node: Node) -> bool:
    """Whether every user of ``node`` is a pointwise aten op (so Inductor fuses it in)."""
    return bool(node.users) and all(
        user.op == "call_function" and torch.Tag.pointwise in getattr(user.target, "tags", ())
        for user in node.users
    )


class MmK1(_MatmulPass):
    """``mm(a, b)`` with inner dimension 1 → ``a * b`` ([M, 1] · [1, N] broadcast) when every
    user is pointwise: one product per element, so the values are bitwise the same, and Inductor
    fuses the multiply into its users' kernel. A lone ``mm`` stays (BLAS writes the [M, N] outer
    product faster than Inductor's loop); Inductor's own rule makes a multiply of it only up to
    32 elements."""

    name = "mm_k1"
    version = "1"
    priority = 35
    summary = "mm with K = 1 feeding pointwise ops → broadcast multiply fused into them"
    targets = (aten.mm.default,)

    def rewrite(self, graph: Graph, node: Node) -> bool:
        if not _feeds_only_pointwise(node):
            return False
        a, b, out = _val(node.args[0]), _val(node.args[1]), _val(node)
        if a is None or b is None or out is None or not _same(a.shape[1], 1) or a.dtype != b.dtype:
            return False
        if not a.dtype.is_floating_point:
            return False
        with graph.inserting_before(node):
            mul = _new_node(graph, aten.mul.Tensor, tuple(node.args))
        _replace(graph, node, mul)
        return True


def _narrow_operand(node: Any, user: Node, dtype: torch.dtype) -> list[Node] | None:
    """The chain ``[convert, x]`` or ``[permute, convert, x]`` under an mm operand that is
    ``convert(x, fp32)`` or ``permute(convert(x, fp32), [1, 0])`` (each link used only by the
    next, ``x`` of ``dtype``), else ``None``."""
    chain = []
    if _is_call(node, aten.permute.default) and _only_user(node, user):
        chain.append(node)
        node, user = node.args[0], node
    if not (_is_call(node, prims.convert_element_type.default) and _only_user(node, user)):
        return None
    source, wide = node.args
    value = _val(source)
    if wide != torch.float32 or value is None or value.dtype != dtype:
        return None
    return [*chain, node, source]


class MmCast(_MatmulPass):
    """``mm(a.to(fp32), b.to(fp32)).to(dt)`` with ``a``, ``b`` already ``dt`` (bf16/fp16; a
    transpose may follow a cast) → ``mm(a, b)`` in ``dt``: the GEMM multiplies the same ``dt``
    values, accumulates in fp32 and rounds to ``dt`` once either way. Not in ``PASSES``: on CPUs
    without native bf16/fp16 GEMM the narrow GEMM is slower (0.45x on AVX2); register it with
    ``spore.register_custom_pass`` where it wins."""

    name = "mm_cast"
    version = "1"
    priority = 30
    summary = "bf16/fp16 → fp32 mm → bf16/fp16 becomes the narrow mm (unregistered: slower)"
    targets = (prims.convert_element_type.default,)

    def rewrite(self, graph: Graph, node: Node) -> bool:
        mm, dtype = node.args
        if dtype not in NARROW_FLOATS or not _is_call(mm, aten.mm.default):
            return False
        if not _only_user(mm, node) or mm.args[0] is mm.args[1]:
            return False
        chains = [_narrow_operand(arg, mm, dtype) for arg in mm.args]
        if chains[0] is None or chains[1] is None:
            return False
        operands = []
        with graph.inserting_before(node):
            for chain in chains:
                source = chain[-1]
                if chain[0].target is aten.permute.default:
                    source = _new_node(graph, aten.permute.default, (source, chain[0].args[1]))
                operands.append(source)
            narrow = _new_node(graph, aten.mm.default, tuple(operands))
        _replace(graph, node, narrow, [mm, *chains[0][:-1], *chains[1][:-1]])
        return True


PASSES = (MmReshapeBias(), MmTranspose(), BmmToMm(), MmK1())

__all__ = [
    "PASSES",
    "BmmToMm",
    "MmCast",
    "MmK1",
    "MmReshapeBias",
    "MmTranspose",
]
