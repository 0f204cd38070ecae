"""Lowering aten nodes (post-AOT-autograd, decompositions applied) to VM instructions.

Each supported op has a :class:`Rule`: its *kind* (what it does to shapes, which the
clusterer needs), an optional node-local check and an emitter that appends instructions to an
:class:`Emitter` in SSA form. :meth:`Emitter.program` allocates physical registers (a dead
value's register is reused) and builds the :class:`~dvm.program.Program`.

Registers hold fp32 values over the domain: 16-bit and bool values widen on load and round on
store; only explicit casts (``_to_copy``/``convert_element_type``) round in between, like a
fused kernel that computes in fp32.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Protocol

import torch
from torch.fx import Node

from dvm import _emitter
from dvm.program import DTYPE_CODES, MAX_DIMS, MAX_REGS, MAX_ROW, Op, Program

aten = torch.ops.aten
prims = torch.ops.prims

POINTWISE = "pointwise"
REDUCE = "reduce"
ROW = "row"  # a row-wise op over the last dim, one eager kernel (softmax): output shaped as input
VIEW = "view"  # same values, only size-1 dimensions added or removed (or none)
EXPAND = "expand"
CONST = "const"


class Resolve(Protocol):
    """A rule's ``r``: ``r(arg)`` is a node argument's value (a constant for a non-node);
    ``r.computed(node)`` whether the region computes ``node`` (else it is loaded, and holds
    its dtype's value exactly)."""

    def __call__(self, x: Any, /) -> int: ...

    def computed(self, node: Node, /) -> bool: ...


class LimitError(ValueError):
    """A program exceeds one of the VM's limits (registers, instructions, inputs, outputs)."""


class Emitter(_emitter.Emitter):
    """Builds one program: SSA values ``v0, v1, ...`` mapped to physical registers at the end.
    An op on the same values as an earlier one gives that one's value (its ops are pure: a
    decomposition that works out ``x - mean`` twice, as LayerNorm's does, makes one pass); so
    does a constant of the same bits (``-0.0`` is not ``0.0``) or a load of the same input.
    The building is C (``csrc/emitter.c``): ``load(index)``, ``const(value)``,
    ``unary(op, a)``, ``binary(op, a, b)``, ``where(cond, a, b)``, ``reduce(op, a)`` give
    values, ``store(value)`` the next output's index; ``n_instrs`` and ``n_outputs`` count;
    ``program(n_inputs)`` allocates registers (a dead value's is reused) and builds the
    :class:`~dvm.program.Program`, a :class:`LimitError` when it needs more than ``MAX_REGS``."""

    __slots__ = ()


_emitter.setup(LimitError, Program.built, MAX_REGS)


@dataclass(frozen=True)
class Rule:
    """How one aten overload lowers: ``kind`` (shape behaviour), ``emit(em, node, r)`` giving
    the result's value (``r`` resolves a node argument to a value), ``check(node)`` a reason
    it cannot lower (``None`` when it can), ``cost`` an upper bound on its instructions."""

    kind: str
    emit: Callable[[Emitter, Node, Resolve], int]
    check: Callable[[Node], str | None] | None = None
    cost: int = 1


RULES: dict[Any, Rule] = {}


def _rule(targets: Sequence[Any], kind: str, check=None, cost: int = 1):
    def register(emit):
        for t in targets:
            RULES[t] = Rule(kind, emit, check, cost)
        return emit

    return register


# ---- pointwise -------------------------------------------------------------------------------

_UNARY = {
    aten.neg.default: Op.NEG,
    aten.abs.default: Op.ABS,
    aten.exp.default: Op.EXP,
    aten.log.default: Op.LOG,
    aten.log1p.default: Op.LOG1P,
    aten.sqrt.default: Op.SQRT,
    aten.rsqrt.default: Op.RSQRT,
    aten.reciprocal.default: Op.RECIPROCAL,
    aten.tanh.default: Op.TANH,
    aten.sigmoid.default: Op.SIGMOID,
    aten.erf.default: Op.ERF,
    aten.sin.default: Op.SIN,
    aten.cos.default: Op.COS,
}
for _t, _op in _UNARY.items():
    RULES[_t] = Rule(POINTWISE, lambda em, n, r, _op=_op: em.unary(_op, r(n.args[0])))

_BINARY = {
    aten.mul.Tensor: Op.MUL,
    aten.mul.Scalar: Op.MUL,
    aten.div.Tensor: Op.DIV,
    aten.div.Scalar: Op.DIV,
    aten.true_divide.Tensor: Op.DIV,
    aten.maximum.default: Op.MAX,
    aten.minimum.default: Op.MIN,
}
for _t, _op in _BINARY.items():
    RULES[_t] = Rule(
        POINTWISE, lambda em, n, r, _op=_op: em.binary(_op, r(n.args[0]), r(n.args[1]))
    )

_COMPARISONS = {
    aten.eq.Tensor: Op.EQ,
    aten.eq.Scalar: Op.EQ,
    aten.ne.Tensor: Op.NE,
    aten.ne.Scalar: Op.NE,
    aten.lt.Tensor: Op.LT,
    aten.lt.Scalar: Op.LT,
    aten.le.Tensor: Op.LE,
    aten.le.Scalar: Op.LE,
    aten.gt.Tensor: Op.GT,
    aten.gt.Scalar: Op.GT,
    aten.ge.Tensor: Op.GE,
    aten.ge.Scalar: Op.GE,
}
_16_BIT = (torch.bfloat16, torch.float16)


def _compared(em: Emitter, n: Node, r: Resolve) -> tuple[int, int]:
    """A comparison's operands as eager compares them: in their common dtype. When that is
    16-bit, a Python scalar or a wider 0-d tensor is rounded to it first (``x == 0.1`` on a
    bfloat16 ``x`` compares with bfloat16's 0.1). A 16-bit value the region computed is held
    in float32 until stored, and is rounded to its dtype first, as eager holds it, whatever the
    common dtype (``x.clamp(max=0.1) == 0.1`` compares two rounded 0.1s; ``sigmoid(x) > t``
    for a float32 ``t`` compares the rounded sigmoid); bool operands widen exactly."""
    a, b = n.args[0], n.args[1]
    operands = [x.meta["val"] if isinstance(x, Node) else x for x in (a, b)]
    if not any(isinstance(v, torch.Tensor) and v.dtype in _16_BIT for v in operands):
        return r(a), r(b)
    from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

    _, common = elementwise_dtypes(
        *operands, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT
    )
    rounds = common in _16_BIT
    values = []
    for x, v in zip((a, b), operands, strict=True):
        if not isinstance(x, Node):
            values.append(em.const(_rounded(x, common) if rounds else x))
        elif v.dtype == torch.bool:
            values.append(r(x))
        elif rounds and v.dtype != common:  # a 0-d tensor of another dtype: held, then cast
            values.append(_cast(em, _held(em, x, r), common))
        else:
            values.append(_held(em, x, r))
    return values[0], values[1]


def _held(em: Emitter, x: Any, r: Resolve) -> int:
    """``x``'s value as eager holds it, for a test to read: a 16-bit value the region computed
    is float32 until stored, and is rounded to its dtype first (a loaded one holds it)."""
    if isinstance(x, Node) and x.meta["val"].dtype in _16_BIT and r.computed(x):
        return _cast(em, r(x), x.meta["val"].dtype)
    return r(x)


def _rounded(value: Any, dtype: torch.dtype) -> Any:
    """``value`` as a tensor of ``dtype`` holds it (bool: 0 or 1; 16-bit: rounded; float32: as
    the program's constants are)."""
    if dtype == torch.bool:
        return float(bool(value))
    if dtype in _16_BIT:
        return torch.tensor(value, dtype=dtype).item()
    return value


for _t, _op in _COMPARISONS.items():
    RULES[_t] = Rule(
        POINTWISE, lambda em, n, r, _op=_op: em.binary(_op, *_compared(em, n, r)), cost=4
    )


# the logical ops test their operands against zero as eager holds them (see _held): an fp16
# value too small for fp16 is zero there
RULES[aten.logical_not.default] = Rule(
    POINTWISE, lambda em, n, r: em.unary(Op.NOT, _held(em, n.args[0], r)), cost=2
)
for _t, _op in {aten.logical_and.default: Op.AND, aten.logical_or.default: Op.OR}.items():
    RULES[_t] = Rule(
        POINTWISE,
        lambda em, n, r, _op=_op: em.binary(_op, _held(em, n.args[0], r), _held(em, n.args[1], r)),
        cost=3,
    )


@_rule([aten.logical_xor.default], POINTWISE, cost=6)
def _xor(em: Emitter, n: Node, r: Resolve) -> int:
    zero = em.const(0.0)
    a = em.binary(Op.NE, _held(em, n.args[0], r), zero)
    return em.binary(Op.NE, a, em.binary(Op.NE, _held(em, n.args[1], r), zero))


def _check_bitwise(node: Node) -> str | None:
    if any(v.dtype != torch.bool for v in _tensor_vals(node)):
        return "bitwise op on non-bool tensors"
    return None


for _t, _op in {
    aten.bitwise_and.Tensor: Op.AND,
    aten.bitwise_or.Tensor: Op.OR,
    aten.bitwise_xor.Tensor: Op.NE,
}.items():
    RULES[_t] = Rule(
        POINTWISE,
        lambda em, n, r, _op=_op: em.binary(_op, r(n.args[0]), r(n.args[1])),
        _check_bitwise,
    )


def _arg(n: Node, k: int, name: str, default: Any) -> Any:
    """``n``'s argument ``name``: positional ``k``, else by keyword, else ``default``."""
    return n.args[k] if len(n.args) > k else n.kwargs.get(name, default)


def _scaled(em: Emitter, value: int, alpha: Any) -> int:
    return value if alpha == 1 else em.binary(Op.MUL, value, em.const(alpha))


@_rule([aten.add.Tensor, aten.add.Scalar], POINTWISE, cost=2)
def _add(em: Emitter, n: Node, r: Resolve) -> int:
    other = _scaled(em, r(n.args[1]), _arg(n, 2, "alpha", 1))  # .Scalar: positional
    return em.binary(Op.ADD, r(n.args[0]), other)


@_rule([aten.sub.Tensor, aten.sub.Scalar], POINTWISE, cost=2)
def _sub(em: Emitter, n: Node, r: Resolve) -> int:
    other = _scaled(em, r(n.args[1]), _arg(n, 2, "alpha", 1))  # .Scalar: positional
    return em.binary(Op.SUB, r(n.args[0]), other)


@_rule([aten.rsub.Scalar, aten.rsub.Tensor], POINTWISE, cost=2)
def _rsub(em: Emitter, n: Node, r: Resolve) -> int:
    alpha = _arg(n, 2, "alpha", 1)
    return em.binary(Op.SUB, r(n.args[1]), _scaled(em, r(n.args[0]), alpha))


def _check_div_mode(node: Node) -> str | None:
    mode = node.kwargs.get("rounding_mode")
    return None if mode is None else f"division with rounding_mode={mode!r}"


@_rule([aten.div.Tensor_mode], POINTWISE, check=_check_div_mode)
def _div_mode(em: Emitter, n: Node, r: Resolve) -> int:
    return em.binary(Op.DIV, r(n.args[0]), r(n.args[1]))


_POW_SPECIAL = {0.5: Op.SQRT, -0.5: Op.RSQRT, -1.0: Op.RECIPROCAL}
# eager takes x ** ±0.5 as sqrt/rsqrt in float32 and bfloat16, but as pow in float16: at -inf
# and -0.0 the two differ (pow(-inf, 0.5) is inf, sqrt(-inf) NaN; pow(-0.0, -0.5) is inf)
_POW_AS_POW = {torch.float16: (0.5, -0.5)}


@_rule([aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.pow.Scalar], POINTWISE, cost=2)
def _pow(em: Emitter, n: Node, r: Resolve) -> int:
    base, exponent = n.args[0], n.args[1]
    if isinstance(exponent, (int, float)) and isinstance(base, Node):
        x = r(base)
        e = float(exponent)
        if e == 1.0:
            return x
        if e == 2.0:
            return em.binary(Op.MUL, x, x)
        if e == 3.0:
            return em.binary(Op.MUL, em.binary(Op.MUL, x, x), x)
        if e in _POW_SPECIAL and e not in _POW_AS_POW.get(n.meta["val"].dtype, ()):
            return em.unary(_POW_SPECIAL[e], x)
    return em.binary(Op.POW, r(base), r(exponent))


@_rule([aten.square.default], POINTWISE)
def _square(em: Emitter, n: Node, r: Resolve) -> int:
    x = r(n.args[0])
    return em.binary(Op.MUL, x, x)


# MAX and MIN give their second operand on a tie (equal signed zeros; a NaN in either gives
# NaN). Eager keeps x against a Python scalar bound (relu(-0.0) is -0.0) and gives a tensor
# bound (clamp.Tensor, clamp_min.Tensor, clamp_max.Tensor, as maximum and minimum give their
# second operand) in its vector loops; its scalar tail (the last n % 16 fp32, n % 32 16-bit
# elements of a contiguous tensor) gives x there, which the VM does not follow.
def _bounded(em: Emitter, op: Op, x: int, bound: Any, r: Resolve) -> int:
    """``op`` (MAX or MIN) of ``x`` and ``bound``, with the operand eager gives on a tie
    second: ``x`` against a Python scalar, the bound against a tensor (a node)."""
    return em.binary(op, x, r(bound)) if isinstance(bound, Node) else em.binary(op, r(bound), x)


@_rule([aten.relu.default], POINTWISE)
def _relu(em: Emitter, n: Node, r: Resolve) -> int:
    return _bounded(em, Op.MAX, r(n.args[0]), 0.0, r)


def _clamp_bounds(n: Node) -> tuple[Any, Any]:
    lo = _arg(n, 1, "min", None)
    hi = _arg(n, 2, "max", None)
    return lo, hi


@_rule([aten.clamp.default, aten.clamp.Tensor], POINTWISE, cost=2)
def _clamp(em: Emitter, n: Node, r: Resolve) -> int:
    x = r(n.args[0])
    lo, hi = _clamp_bounds(n)
    if lo is not None:
        x = _bounded(em, Op.MAX, x, lo, r)
    if hi is not None:
        x = _bounded(em, Op.MIN, x, hi, r)
    return x


@_rule([aten.clamp_min.default, aten.clamp_min.Tensor], POINTWISE)
def _clamp_min(em: Emitter, n: Node, r: Resolve) -> int:
    return _bounded(em, Op.MAX, r(n.args[0]), n.args[1], r)


@_rule([aten.clamp_max.default, aten.clamp_max.Tensor], POINTWISE)
def _clamp_max(em: Emitter, n: Node, r: Resolve) -> int:
    return _bounded(em, Op.MIN, r(n.args[0]), n.args[1], r)


@_rule(
    [aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar],
    POINTWISE,
)
def _where(em: Emitter, n: Node, r: Resolve) -> int:
    return em.where(r(n.args[0]), r(n.args[1]), r(n.args[2]))


_GELU_TANH_BETA = math.sqrt(2.0 / math.pi)
_GELU_TANH_KAPPA = 0.044715


@_rule([aten.gelu.default], POINTWISE, cost=11)
def _gelu(em: Emitter, n: Node, r: Resolve) -> int:
    """The erf form as one GELU instruction (one pass, where its decomposition takes five);
    the tanh form as its decomposition's operations."""
    x = r(n.args[0])
    if _arg(n, 1, "approximate", "none") == "none":
        return em.unary(Op.GELU, x)
    cube = em.binary(Op.MUL, em.binary(Op.MUL, x, x), x)
    inner = em.binary(Op.ADD, x, em.binary(Op.MUL, em.const(_GELU_TANH_KAPPA), cube))
    t = em.unary(Op.TANH, em.binary(Op.MUL, em.const(_GELU_TANH_BETA), inner))
    half_x = em.binary(Op.MUL, em.const(0.5), x)
    return em.binary(Op.MUL, half_x, em.binary(Op.ADD, em.const(1.0), t))


# The backward of SiLU and GELU are one eager kernel each, which a VM region of one of them
# alone does not beat (0.65x and 0.73x at a small Llama's MLP shape): kept whole, they stay that
# kernel alone (``min_ops``) and join a region with ops around them (a gated MLP's muls).


@_rule([aten.silu_backward.default], POINTWISE, cost=8)
def _silu_backward(em: Emitter, n: Node, r: Resolve) -> int:
    grad, x = r(n.args[0]), r(n.args[1])
    s = em.unary(Op.SIGMOID, x)
    one = em.const(1.0)
    slope = em.binary(Op.ADD, one, em.binary(Op.MUL, x, em.binary(Op.SUB, one, s)))
    return em.binary(Op.MUL, em.binary(Op.MUL, grad, s), slope)


_SQRT1_2 = math.sqrt(0.5)
_PDF_SCALE = 1.0 / math.sqrt(2.0 * math.pi)


@_rule([aten.gelu_backward.default], POINTWISE, cost=24)
def _gelu_backward(em: Emitter, n: Node, r: Resolve) -> int:
    grad, x = r(n.args[0]), r(n.args[1])
    half = em.const(0.5)
    one = em.const(1.0)
    x_sq = em.binary(Op.MUL, x, x)
    if _arg(n, 2, "approximate", "none") == "none":
        cdf = em.binary(
            Op.MUL,
            half,
            em.binary(Op.ADD, one, em.unary(Op.ERF, em.binary(Op.MUL, x, em.const(_SQRT1_2)))),
        )
        gauss = em.unary(Op.EXP, em.binary(Op.MUL, x_sq, em.const(-0.5)))
        pdf = em.binary(Op.MUL, em.const(_PDF_SCALE), gauss)
        return em.binary(Op.MUL, grad, em.binary(Op.ADD, cdf, em.binary(Op.MUL, x, pdf)))
    beta, kappa = em.const(_GELU_TANH_BETA), em.const(_GELU_TANH_KAPPA)
    cube = em.binary(Op.MUL, x_sq, x)
    t = em.unary(
        Op.TANH, em.binary(Op.MUL, beta, em.binary(Op.ADD, x, em.binary(Op.MUL, kappa, cube)))
    )
    left_derivative = em.binary(Op.MUL, half, em.binary(Op.ADD, one, t))
    tanh_derivative = em.binary(Op.SUB, one, em.binary(Op.MUL, t, t))
    inner = em.binary(Op.ADD, one, em.binary(Op.MUL, em.const(3.0 * _GELU_TANH_KAPPA), x_sq))
    right = em.binary(
        Op.MUL,
        em.binary(Op.MUL, em.binary(Op.MUL, half, x), tanh_derivative),
        em.binary(Op.MUL, beta, inner),
    )
    return em.binary(Op.MUL, grad, em.binary(Op.ADD, left_derivative, right))


# ---- composites kept whole ---------------------------------------------------------------------
# Each is one eager kernel that a VM region of its decomposition alone lost to
# (tools/whole_ops.py: 0.23-0.68x at 2x128x688 fp32, 0.44-0.92x at 1024x4096): kept whole,
# it stays that kernel alone (``min_ops``) and joins a region with ops around it. The rules
# follow the math of PyTorch's CPU kernels, in its order.


@_rule([aten.silu.default], POINTWISE, cost=2)
def _silu(em: Emitter, n: Node, r: Resolve) -> int:
    x = r(n.args[0])
    return em.binary(Op.MUL, x, em.unary(Op.SIGMOID, x))


@_rule([aten.hardsigmoid.default], POINTWISE, cost=6)
def _hardsigmoid(em: Emitter, n: Node, r: Resolve) -> int:
    return em.binary(Op.DIV, _relu6_of_x_plus_3(em, r(n.args[0])), em.const(6.0))


@_rule([aten.hardswish.default], POINTWISE, cost=7)
def _hardswish(em: Emitter, n: Node, r: Resolve) -> int:
    x = r(n.args[0])
    return em.binary(Op.DIV, em.binary(Op.MUL, x, _relu6_of_x_plus_3(em, x)), em.const(6.0))


def _relu6_of_x_plus_3(em: Emitter, x: int) -> int:
    shifted = em.binary(Op.ADD, x, em.const(3.0))
    return em.binary(Op.MIN, em.binary(Op.MAX, shifted, em.const(0.0)), em.const(6.0))


@_rule([aten.leaky_relu.default], POINTWISE, cost=5)
def _leaky_relu(em: Emitter, n: Node, r: Resolve) -> int:
    x = r(n.args[0])
    slope = em.const(_arg(n, 1, "negative_slope", 0.01))
    return em.where(em.binary(Op.GT, x, em.const(0.0)), x, em.binary(Op.MUL, x, slope))


@_rule([aten.elu.default], POINTWISE, cost=8)
def _elu(em: Emitter, n: Node, r: Resolve) -> int:
    """The negative side as ``exp(x) - 1`` (the VM has no expm1, which PyTorch's kernel uses):
    off by about 1e-7 near 0, a large relative error for tiny x."""
    x = r(n.args[0])
    alpha, scale = _arg(n, 1, "alpha", 1), _arg(n, 2, "scale", 1)
    input_scale = _arg(n, 3, "input_scale", 1)
    negative = em.binary(Op.SUB, em.unary(Op.EXP, _scaled(em, x, input_scale)), em.const(1.0))
    negative = _scaled(em, negative, alpha * scale)
    return em.where(em.binary(Op.LE, x, em.const(0.0)), negative, _scaled(em, x, scale))


@_rule([aten.addcmul.default], POINTWISE, cost=4)
def _addcmul(em: Emitter, n: Node, r: Resolve) -> int:
    product = _scaled(em, r(n.args[1]), _arg(n, 3, "value", 1))
    return em.binary(Op.ADD, r(n.args[0]), em.binary(Op.MUL, product, r(n.args[2])))


@_rule([aten.addcdiv.default], POINTWISE, cost=4)
def _addcdiv(em: Emitter, n: Node, r: Resolve) -> int:
    quotient = _scaled(em, r(n.args[1]), _arg(n, 3, "value", 1))
    return em.binary(Op.ADD, r(n.args[0]), em.binary(Op.DIV, quotient, r(n.args[2])))


@_rule([aten.lerp.Scalar, aten.lerp.Tensor], POINTWISE, cost=9)
def _lerp(em: Emitter, n: Node, r: Resolve) -> int:
    """PyTorch's two forms: ``start + w (end - start)`` for ``|w| < 0.5``, else
    ``end - (end - start)(1 - w)``."""
    start, end, weight = r(n.args[0]), r(n.args[1]), n.args[2]
    w = r(weight)
    diff = em.binary(Op.SUB, end, start)

    def small() -> int:
        return em.binary(Op.ADD, start, em.binary(Op.MUL, w, diff))

    def large() -> int:
        return em.binary(Op.SUB, end, em.binary(Op.MUL, diff, em.binary(Op.SUB, em.const(1.0), w)))

    if not isinstance(weight, Node):  # a scalar weight: only its form is emitted
        return small() if abs(weight) < 0.5 else large()
    is_small = em.binary(Op.LT, em.unary(Op.ABS, w), em.const(0.5))
    return em.where(is_small, small(), large())


@_rule([aten.threshold_backward.default], POINTWISE, cost=5)
def _threshold_backward(em: Emitter, n: Node, r: Resolve) -> int:
    below = em.binary(Op.LE, _held(em, n.args[1], r), em.const(n.args[2]))
    return em.where(below, em.const(0.0), r(n.args[0]))


@_rule([aten.sigmoid_backward.default], POINTWISE, cost=4)
def _sigmoid_backward(em: Emitter, n: Node, r: Resolve) -> int:
    grad, y = r(n.args[0]), r(n.args[1])
    return em.binary(Op.MUL, em.binary(Op.MUL, grad, em.binary(Op.SUB, em.const(1.0), y)), y)


@_rule([aten.tanh_backward.default], POINTWISE, cost=4)
def _tanh_backward(em: Emitter, n: Node, r: Resolve) -> int:
    grad, y = r(n.args[0]), r(n.args[1])
    return em.binary(Op.MUL, grad, em.binary(Op.SUB, em.const(1.0), em.binary(Op.MUL, y, y)))


@_rule([aten.leaky_relu_backward.default], POINTWISE, cost=6)
def _leaky_relu_backward(em: Emitter, n: Node, r: Resolve) -> int:
    grad, x = r(n.args[0]), _held(em, n.args[1], r)
    scaled = em.binary(Op.MUL, grad, em.const(n.args[2]))
    return em.where(em.binary(Op.GT, x, em.const(0.0)), grad, scaled)


@_rule([aten.hardtanh_backward.default], POINTWISE, cost=7)
def _hardtanh_backward(em: Emitter, n: Node, r: Resolve) -> int:
    """``grad`` strictly inside (min, max), else 0: a NaN input gives 0, as PyTorch's vector
    loop does (its scalar tail gives ``grad``)."""
    grad, x = r(n.args[0]), _held(em, n.args[1], r)
    above = em.binary(Op.GT, x, em.const(n.args[2]))
    inside = em.binary(Op.AND, above, em.binary(Op.LT, x, em.const(n.args[3])))
    return em.where(inside, grad, em.const(0.0))


@_rule([aten.elu_backward.default], POINTWISE, cost=10)
def _elu_backward(em: Emitter, n: Node, r: Resolve) -> int:
    grad, alpha, scale, input_scale, is_result, b = n.args[:6]
    g, v = r(grad), _held(em, b, r)
    negcoef = alpha * scale
    if is_result:  # b is the forward's result
        negative = em.binary(Op.ADD, v, em.const(negcoef))
        negative = em.binary(Op.MUL, em.binary(Op.MUL, g, em.const(input_scale)), negative)
    else:
        negative = em.binary(Op.MUL, em.binary(Op.MUL, g, em.const(input_scale)), em.const(negcoef))
        negative = em.binary(Op.MUL, negative, em.unary(Op.EXP, _scaled(em, v, input_scale)))
    positive = em.binary(Op.MUL, g, em.const(scale))
    return em.where(em.binary(Op.LE, v, em.const(0.0)), negative, positive)


@_rule([aten.softplus_backward.default], POINTWISE, cost=9)
def _softplus_backward(em: Emitter, n: Node, r: Resolve) -> int:
    grad, x = r(n.args[0]), r(n.args[1])
    scaled = _scaled(em, x, n.args[2])
    z = em.unary(Op.EXP, scaled)
    soft = em.binary(Op.DIV, em.binary(Op.MUL, grad, z), em.binary(Op.ADD, z, em.const(1.0)))
    return em.where(em.binary(Op.GT, scaled, em.const(n.args[3])), grad, soft)


@_rule([aten.mse_loss_backward.default], POINTWISE, cost=5)
def _mse_loss_backward(em: Emitter, n: Node, r: Resolve) -> int:
    grad, x, target, reduction = n.args[:4]
    norm = 2.0 / x.meta["val"].numel() if reduction == 1 else 2.0  # 1: Reduction::Mean
    diff = em.binary(Op.MUL, em.const(norm), em.binary(Op.SUB, r(x), r(target)))
    return em.binary(Op.MUL, diff, r(grad))


# ---- casts and views -------------------------------------------------------------------------


def _cast(em: Emitter, value: int, dtype: torch.dtype) -> int:
    if dtype == torch.bfloat16:
        return em.unary(Op.CAST_BF16, value)
    if dtype == torch.float16:
        return em.unary(Op.CAST_F16, value)
    if dtype == torch.bool:
        return em.binary(Op.NE, value, em.const(0.0))
    return value


def _check_to_copy(node: Node) -> str | None:
    device = node.kwargs.get("device")
    if device is not None and torch.device(device).type != "cpu":
        return f"copy to device {device}"
    return None


def _converted(em: Emitter, x: Any, dtype: torch.dtype, r: Resolve) -> int:
    """``x`` cast to ``dtype``: a computed 16-bit value goes on in float32 across a cast to
    float32 (as in Inductor's code), and is first rounded as eager holds it for any other
    (``.bool()`` of an fp16 value too small for fp16 is False; fp16 to bf16 rounds twice)."""
    return _cast(em, r(x) if dtype == torch.float32 else _held(em, x, r), dtype)


@_rule([aten._to_copy.default], VIEW, check=_check_to_copy, cost=3)
def _to_copy(em: Emitter, n: Node, r: Resolve) -> int:
    return _converted(em, n.args[0], n.meta["val"].dtype, r)


@_rule([prims.convert_element_type.default], VIEW, cost=3)
def _convert(em: Emitter, n: Node, r: Resolve) -> int:
    return _converted(em, n.args[0], n.args[1], r)


VIEW_REFUSAL = "view that changes the layout (not only size-1 dimensions)"
"""Why the VM refuses a view that moves values (``csrc/analysis.c`` gives it too)."""


def _check_view(node: Node) -> str | None:
    x = node.args[0]
    if not isinstance(x, Node) or not isinstance(x.meta.get("val"), torch.Tensor):
        return "view of a non-tensor"
    src = [s for s in x.meta["val"].shape if s != 1]
    dst = [s for s in node.meta["val"].shape if s != 1]
    if src != dst:
        return VIEW_REFUSAL
    return None


VIEW_OPS = (
    aten.alias.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.unsqueeze.default,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
)
"""The ops whose result is a view of their first argument with its values (expand aside)."""


@_rule([aten.clone.default, *VIEW_OPS], VIEW, check=_check_view, cost=0)
def _identity(em: Emitter, n: Node, r: Resolve) -> int:
    return r(n.args[0])


@_rule([aten.expand.default], EXPAND, cost=0)
def _expand(em: Emitter, n: Node, r: Resolve) -> int:
    return r(n.args[0])


@_rule([aten.full.default], CONST)
def _full(em: Emitter, n: Node, r: Resolve) -> int:
    return em.const(_rounded(n.args[1], n.meta["val"].dtype))


@_rule([aten.scalar_tensor.default], CONST)
def _scalar_tensor(em: Emitter, n: Node, r: Resolve) -> int:
    return em.const(_rounded(n.args[0], n.meta["val"].dtype))


# ---- row reductions --------------------------------------------------------------------------


def reduced_dims(node: Node) -> list[int]:
    """The dimensions ``node`` (a reduction) reduces, normalised to ``0..rank-1``."""
    rank = node.args[0].meta["val"].dim()
    if rank == 0:
        return []
    dims = _arg(node, 1, "dim", None)
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    return sorted({d % rank for d in dims})


def keepdim(node: Node) -> bool:
    return bool(_arg(node, 2, "keepdim", False))


def row_reduction(node: Node) -> bool:
    """Whether ``node`` reduces a row of more than one element (else it is the identity)."""
    shape = node.args[0].meta["val"].shape
    return len(shape) > 0 and (len(shape) - 1) in reduced_dims(node) and shape[-1] != 1


def _long_row(length: int) -> str | None:
    """Why a row of ``length`` elements cannot be reduced on the VM, ``None`` when it can."""
    if length > MAX_ROW:
        return (
            f"rows of {length} elements: a reducing program holds whole rows in its registers, "
            f"at most {MAX_ROW} elements"
        )
    return None


def _check_reduce(node: Node) -> str | None:
    if node.kwargs.get("dtype") is not None:
        return "reduction with a dtype argument"
    shape = node.args[0].meta["val"].shape
    for d in reduced_dims(node):
        if d != len(shape) - 1 and shape[d] != 1:
            return f"reduction over dim {d} (size {shape[d]}): the VM reduces only the last dim"
    return _long_row(shape[-1]) if row_reduction(node) else None


def _reduction(op: Op):
    def emit(em: Emitter, n: Node, r: Resolve) -> int:
        x = r(n.args[0])
        return em.reduce(op, x) if row_reduction(n) else x

    return emit


RULES[aten.sum.dim_IntList] = Rule(REDUCE, _reduction(Op.REDUCE_SUM), _check_reduce)
RULES[aten.sum.default] = Rule(REDUCE, _reduction(Op.REDUCE_SUM), _check_reduce)
RULES[aten.mean.dim] = Rule(REDUCE, _reduction(Op.REDUCE_MEAN), _check_reduce)
RULES[aten.mean.default] = Rule(REDUCE, _reduction(Op.REDUCE_MEAN), _check_reduce)
RULES[aten.amax.default] = Rule(REDUCE, _reduction(Op.REDUCE_MAX), _check_reduce)


@_rule([aten.amin.default], REDUCE, check=_check_reduce, cost=3)
def _amin(em: Emitter, n: Node, r: Resolve) -> int:
    x = r(n.args[0])
    if not row_reduction(n):
        return x
    return em.unary(Op.NEG, em.reduce(Op.REDUCE_MAX, em.unary(Op.NEG, x)))


# ---- softmax and log-softmax, whole ----------------------------------------------------------
# Each is one eager kernel, which a VM region of the op alone does not beat (0.5-0.8x at a small
# Llama's shapes): kept whole, a region of one of them alone stays eager (``min_ops``), and with
# ops around it the rule emits its decomposition's instructions into their region.


@functools.cache
def _row_check(dim_at: int) -> Callable[[Node], str | None]:
    """The check of a row op whose dim is argument ``dim_at`` (one function for each)."""

    def check(node: Node) -> str | None:
        shape = node.args[0].meta["val"].shape
        dim = node.args[dim_at]
        if len(shape) == 0 or dim % len(shape) != len(shape) - 1:
            return f"over dim {dim} of a {len(shape)}-d tensor: the VM reduces only the last dim"
        if shape[-1] == 1:
            return "over a dim of size 1"
        if dim_at == 1 and node.args[2]:
            return "half_to_float"
        return _long_row(shape[-1])

    return check


@_rule([aten._softmax.default], ROW, check=_row_check(1), cost=6)
def _softmax(em: Emitter, n: Node, r: Resolve) -> int:
    x = r(n.args[0])
    e = em.unary(Op.EXP, em.binary(Op.SUB, x, em.reduce(Op.REDUCE_MAX, x)))
    return em.binary(Op.DIV, e, em.reduce(Op.REDUCE_SUM, e))


@_rule([aten._log_softmax.default], ROW, check=_row_check(1), cost=6)
def _log_softmax(em: Emitter, n: Node, r: Resolve) -> int:
    x = r(n.args[0])
    shifted = em.binary(Op.SUB, x, em.reduce(Op.REDUCE_MAX, x))
    total = em.reduce(Op.REDUCE_SUM, em.unary(Op.EXP, shifted))
    return em.binary(Op.SUB, shifted, em.unary(Op.LOG, total))


@_rule([aten._softmax_backward_data.default], ROW, check=_row_check(2), cost=5)
def _softmax_backward(em: Emitter, n: Node, r: Resolve) -> int:
    grad, out = r(n.args[0]), r(n.args[1])
    scaled = em.binary(Op.MUL, grad, out)
    total = em.reduce(Op.REDUCE_SUM, scaled)
    return em.binary(Op.SUB, scaled, em.binary(Op.MUL, out, total))


@_rule([aten._log_softmax_backward_data.default], ROW, check=_row_check(2), cost=5)
def _log_softmax_backward(em: Emitter, n: Node, r: Resolve) -> int:
    grad, out = r(n.args[0]), r(n.args[1])
    total = em.reduce(Op.REDUCE_SUM, grad)
    return em.binary(Op.SUB, grad, em.binary(Op.MUL, em.unary(Op.EXP, out), total))


# ---- the rules C emits itself ----------------------------------------------------------------


class Form(IntEnum):
    """How ``csrc/emitter.c`` lowers a node of a common rule without calling it: the
    instructions its rule here emits for the node, in the same order (the rule stays the
    definition, and the oracle the tests compare with). A node whose arguments the form does
    not take (keywords, an ``alpha``, a ``pow`` exponent of ``±0.5``) goes to the rule."""

    UNARY = 0  # op(x)
    BINARY = 1  # op(a, b)
    ADD_SUB = 2  # op(a, b), no alpha
    POW = 3
    SQUARE = 4
    REDUCE = 5  # op over the last dim, when it reduces it (row_reduction)
    WHERE = 6
    IDENTITY = 7  # views, clone, expand
    SILU = 8
    RELU = 9
    SOFTMAX = 10
    LOG_SOFTMAX = 11
    SOFTMAX_BACKWARD = 12
    LOG_SOFTMAX_BACKWARD = 13
    TO_COPY = 14
    CONVERT = 15


NATIVE: dict[Any, tuple[Form, int]] = {
    **{t: (Form.UNARY, op) for t, op in _UNARY.items()},
    **{t: (Form.BINARY, op) for t, op in _BINARY.items()},
    aten.bitwise_and.Tensor: (Form.BINARY, Op.AND),
    aten.bitwise_or.Tensor: (Form.BINARY, Op.OR),
    aten.bitwise_xor.Tensor: (Form.BINARY, Op.NE),
    aten.add.Tensor: (Form.ADD_SUB, Op.ADD),
    aten.add.Scalar: (Form.ADD_SUB, Op.ADD),
    aten.sub.Tensor: (Form.ADD_SUB, Op.SUB),
    aten.sub.Scalar: (Form.ADD_SUB, Op.SUB),
    aten.sum.dim_IntList: (Form.REDUCE, Op.REDUCE_SUM),
    aten.sum.default: (Form.REDUCE, Op.REDUCE_SUM),
    aten.mean.dim: (Form.REDUCE, Op.REDUCE_MEAN),
    aten.mean.default: (Form.REDUCE, Op.REDUCE_MEAN),
    aten.amax.default: (Form.REDUCE, Op.REDUCE_MAX),
    **{t: (Form.POW, 0) for t in (aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.pow.Scalar)},
    aten.square.default: (Form.SQUARE, 0),
    **{
        t: (Form.WHERE, 0)
        for t in (aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
    },
    **{t: (Form.IDENTITY, 0) for t in (aten.clone.default, aten.expand.default, *VIEW_OPS)},
    aten.silu.default: (Form.SILU, 0),
    aten.relu.default: (Form.RELU, 0),
    aten._softmax.default: (Form.SOFTMAX, 0),
    aten._log_softmax.default: (Form.LOG_SOFTMAX, 0),
    aten._softmax_backward_data.default: (Form.SOFTMAX_BACKWARD, 0),
    aten._log_softmax_backward_data.default: (Form.LOG_SOFTMAX_BACKWARD, 0),
    aten._to_copy.default: (Form.TO_COPY, 0),
    prims.convert_element_type.default: (Form.CONVERT, 0),
}
"""The rules ``build_region`` lowers in C, by target: each one's :class:`Form` and op (0 for
a form of none). ``_emitter.setup_native({}, NATIVE_DTYPES)`` leaves every node to its rule."""

NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.bool)
"""The dtypes the casts tell apart, for ``_emitter.setup_native``."""

_emitter.setup_native(NATIVE, NATIVE_DTYPES)


# ---- what the VM takes -----------------------------------------------------------------------


def _tensor_vals(node: Node) -> list[torch.Tensor]:
    return [x.meta.get("val") for x in node.all_input_nodes]


Fact = tuple[torch.Size, torch.dtype, int]
"""A value the VM takes: its shape, dtype and number of elements."""


def value_fact(v: Any) -> Fact | str:
    """The shape, dtype and size of a value with this fake tensor when the VM takes it, else
    why it does not (a ``str``)."""
    if not isinstance(v, torch.Tensor):
        return "an argument has no tensor value in meta['val']"
    dtype = v.dtype
    if dtype not in DTYPE_CODES:
        return f"dtype {dtype}: the VM takes float32, bfloat16, float16 and bool"
    if v.device.type != "cpu":
        return f"device {v.device}: the VM runs on CPU"
    shape, numel = v.shape, v.numel()
    if type(numel) is not int:  # a symbolic size makes the product symbolic
        return f"dynamic shape {tuple(shape)}"
    if len(shape) > MAX_DIMS:
        return f"{len(shape)} dims (the VM takes {MAX_DIMS})"
    if numel == 0:
        return "empty tensor"
    return shape, dtype, numel


def unsupported_reason(node: Node, facts: dict[Node, Fact | str] | None = None) -> str | None:
    """Why ``node`` cannot run on the VM (op, dtype, reduction dim, dynamic shape, device...),
    or ``None`` when it can; needs the fake value ``node.meta["val"]`` of it and its inputs.
    ``facts`` caches each value's :func:`value_fact` across the calls for one graph."""
    if node.op != "call_function":
        return f"{node.op} node"
    if node.target is operator.getitem:
        return "getitem of a multi-output op"
    rule = RULES.get(node.target)
    if rule is None:
        why = KEPT_WHOLE.get(node.target)
        return why or f"op {op_name(node.target)} has no VM lowering"
    return rule_reason(node, rule, node.all_input_nodes, {} if facts is None else facts)


def rule_reason(
    node: Node, rule: Rule, inputs: Sequence[Node], facts: dict[Node, Fact | str]
) -> str | None:
    """:func:`unsupported_reason` for a call node whose op has ``rule``, its tensor
    arguments ``inputs`` given; records each value's fact in ``facts``."""
    for x in (node, *inputs):
        fact = facts.get(x)
        if fact is None:
            v = x.meta.get("val")
            if x is node and not isinstance(v, torch.Tensor):
                return "no tensor value in node.meta['val'] (run FakeTensorProp first)"
            fact = facts[x] = value_fact(v)
        if type(fact) is str:
            return fact
    dtype = facts[node][1]
    if dtype == torch.bool and rule.kind == POINTWISE and node.target not in _BOOL_OUT:
        return f"op {op_name(node.target)} with a bool result"
    for args in (node.args, node.kwargs.values()):
        for a in args:
            if type(a) is complex:
                return "complex scalar argument"
            if _beyond(a, dtype):
                return (
                    f"scalar {a!r} beyond {dtype}'s range: eager's op raises or saturates for "
                    "it, each its own way"
                )
    if rule.check is not None:
        return rule.check(node)
    return None


FLOAT_LIMITS = {d: torch.finfo(d).max for d in (torch.float32, *_16_BIT)}
"""Each VM float dtype's largest finite value."""


def _beyond(value: Any, dtype: torch.dtype) -> bool:
    """``value`` is a finite Python int or float beyond the range of ``dtype`` (a VM float)."""
    limit = FLOAT_LIMITS.get(dtype)
    if limit is None or type(value) not in (int, float):
        return False
    try:
        return math.isfinite(value) and abs(value) > limit
    except OverflowError:  # an int too large for a float
        return True


_BOOL_OUT = {
    *_COMPARISONS,
    aten.logical_and.default,
    aten.logical_or.default,
    aten.logical_not.default,
    aten.logical_xor.default,
    aten.bitwise_and.Tensor,
    aten.bitwise_or.Tensor,
    aten.bitwise_xor.Tensor,
    aten.where.self,
    aten.where.ScalarSelf,
    aten.where.ScalarOther,
    aten.where.Scalar,
}


_TORCH_OPS = (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)


def op_name(target: Any) -> str:
    """How a node's target reads in regions and fallbacks: a torch op as torch prints it
    (``aten.add.Tensor``, ``auto_functionalized``), a Python function by module and name
    (``operator.getitem``, ``math.fabs``), a method or module call by its name."""
    if isinstance(target, (str, *_TORCH_OPS)):
        return str(target)
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    if name is None:  # a callable object
        return str(target)
    module = getattr(target, "__module__", None)
    module = {"_operator": "operator"}.get(module, module)
    return f"{module}.{name}" if module else name


# ---- decompositions --------------------------------------------------------------------------


def _moments(x: torch.Tensor, dim, correction, keepdim: bool):
    """Variance and mean of ``x`` over ``dim`` (``None`` or ``[]``: every dim, as eager), a
    16-bit ``x`` in float32 as eager's kernels accumulate (also where the reductions stay eager
    aten, over a dim other than the last); neither rounded back."""
    dims = list(dim) if dim else list(range(x.dim()))
    n = 1
    for d in dims:
        n *= x.shape[d] if x.dim() else 1  # a 0-d x takes dim 0 or -1 as eager does: one value
    wide = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
    mean = torch.mean(wide, dims, keepdim=True)
    centred = wide - mean
    var = torch.sum(centred * centred, dims, keepdim=keepdim) / max(
        n - (1 if correction is None else correction), 0
    )
    return var, mean if keepdim else torch.squeeze(mean, dims)


def _var_mean(x: torch.Tensor, dim=None, *, correction=None, keepdim: bool = False):
    """``var_mean``, each result rounded once (see :func:`_moments`)."""
    var, mean = _moments(x, dim, correction, keepdim)
    return var.to(x.dtype), mean.to(x.dtype)


def _var(x: torch.Tensor, dim=None, *, correction=None, keepdim: bool = False):
    """``var`` (``Tensor.var``), rounded once (see :func:`_moments`)."""
    return _moments(x, dim, correction, keepdim)[0].to(x.dtype)


def _std(x: torch.Tensor, dim=None, *, correction=None, keepdim: bool = False):
    """``std``: the square root of the unrounded variance, rounded once."""
    return torch.sqrt(_moments(x, dim, correction, keepdim)[0]).to(x.dtype)


_LAYER_NORM_WHOLE = (
    "LayerNorm is kept whole: PyTorch's kernel beats the VM's program of its decomposition, "
    "alone or fused (dvm's README, LayerNorm)"
)
KEPT_WHOLE = {  # composites the VM could run decomposed, left whole by measurement: why
    aten.native_layer_norm.default: _LAYER_NORM_WHOLE,
    aten.native_layer_norm_backward.default: _LAYER_NORM_WHOLE,
    aten.mse_loss.default: (
        "mse_loss is kept whole: it reduces over every dim, and its decomposition on the VM ran at "
        "0.29-0.68x PyTorch's kernel (tools/whole_ops.py)"
    ),
}

_FUSIBLE = [  # composites whose decompositions are ops the VM lowers
    aten.softplus,
    aten.mish,
    aten.hardtanh,
    aten.logsumexp,
    aten.rsub,
    aten.masked_fill,
    aten.detach,
]


def _masked_fill(decomposed: Callable[..., Any], x: torch.Tensor, mask: Any, value: Any) -> Any:
    """``decomposed(x, mask, value)``, but the op traced whole (``NotImplemented``) for a
    ``value`` that ``x``'s dtype cannot hold: decomposed, the fill is a ``scalar_tensor``, which
    in 16 bits takes an infinity where ``masked_fill`` raises."""
    if _beyond(value, x.dtype):
        return NotImplemented
    return decomposed(x, mask, value)


def decomposition_table(also: Sequence[Any] = ()) -> dict[Any, Callable[..., Any]]:
    """The composites whose decompositions the VM can fuse (:data:`_FUSIBLE`: softplus, mish,
    hardtanh, logsumexp, rsub, masked_fill, detach; and var_mean, var, std); GELU stays
    whole, one instruction (its erf form) or its tanh form's operations (see ``_gelu``), and
    so do SiLU, the other activations and the backward of each (lowered whole: see
    ``_silu``), addcmul, addcdiv, lerp, and softmax, log-softmax and their backward (a row op
    each: see ``_softmax``). LayerNorm, its backward and mse_loss stay PyTorch's kernels
    (:data:`KEPT_WHOLE`). Other ops stay whole: decomposed, an op the VM cannot take
    (embedding backward, NLL loss, slicing backward) runs as several eager kernels instead of
    one. ``also``: more ops (or overload packets) to decompose with
    PyTorch's decompositions, e.g. one dvm keeps whole, to time it decomposed."""
    from torch._decomp import get_decompositions

    table = get_decompositions([*_FUSIBLE, *also])
    scalar_fill = table.get(aten.masked_fill.Scalar)
    if scalar_fill is not None:
        table[aten.masked_fill.Scalar] = functools.partial(_masked_fill, scalar_fill)
    table[aten.var_mean.correction] = _var_mean
    table[aten.var.correction] = _var
    table[aten.std.correction] = _std
    return table
