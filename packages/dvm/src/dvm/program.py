"""VM programs: the instruction set, its encoding for the C++ VM, and a reference executor.

A program runs over a *domain*, an N-d shape whose last dimension is the *row*. Every operand
(input or output) is a tensor broadcastable to the domain; its strides over the domain (0 along
a broadcast dimension) say where element ``(i0, ..., ik)`` lives, so strided and broadcast
loads need no copies. Registers hold fp32 values over the domain; ``REDUCE_*`` reduce a
register along the row and broadcast the result back along it (softmax, norms). An output
whose last dimension is 1 while the domain's is not receives the row's first value (a reduced
row). Arithmetic is fp32 whatever the operand dtypes; loads widen, stores round to nearest even.

The numbers of :class:`Op` are shared with ``csrc/vm.h``: change both together and bump
``dvm._lib.ABI_VERSION``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

import torch

MAX_DIMS = 6
MAX_REGS = 32
MAX_INPUTS = 16
MAX_OUTPUTS = 8
MAX_INSTRS = 256
MAX_ROW = 1 << 16
"""The longest row a reducing program takes (``dvm_max_row``): its registers hold whole rows."""
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.bool: 3}


class Op(IntEnum):
    """One VM instruction: ``dst <- f(a, b, c)``; operand meaning per group below."""

    # data movement
    LOAD = 0  # dst <- input[a]
    CONST = 1  # dst <- imm
    STORE = 2  # output[a] <- register b (dst unused, -1)
    # unary: dst <- f(a)
    NEG = 10
    ABS = 11
    EXP = 12
    LOG = 13
    LOG1P = 14
    SQRT = 15
    RSQRT = 16
    RECIPROCAL = 17
    TANH = 18
    SIGMOID = 19
    ERF = 20
    SIN = 21
    COS = 22
    NOT = 23  # 1 where a == 0, else 0
    CAST_BF16 = 24  # a rounded to bfloat16 precision (the value stays fp32)
    CAST_F16 = 25  # a rounded to float16 precision
    GELU = 26  # (a / 2) (1 + erf(a / sqrt 2)), GELU's erf form
    # binary: dst <- f(a, b); comparisons give 1.0 or 0.0
    ADD = 40
    SUB = 41
    MUL = 42
    DIV = 43
    POW = 44
    MAX = 45  # NaN if either is NaN (torch.maximum)
    MIN = 46
    EQ = 47
    NE = 48
    LT = 49
    LE = 50
    GT = 51
    GE = 52
    AND = 53  # 1 where a != 0 and b != 0
    OR = 54
    # ternary
    WHERE = 60  # dst <- b where a != 0 else c
    # row reductions, broadcast back along the row
    REDUCE_SUM = 70
    REDUCE_MAX = 71  # NaN if any is NaN
    REDUCE_MEAN = 72


UNARY = frozenset(op for op in Op if 10 <= op < 40)
BINARY = frozenset(op for op in Op if 40 <= op < 60)
REDUCTIONS = frozenset({Op.REDUCE_SUM, Op.REDUCE_MAX, Op.REDUCE_MEAN})
_LOAD, _STORE = Op.LOAD, Op.STORE  # bound once: an enum attribute lookup costs ~1 µs
_NO_READS = frozenset({Op.LOAD, Op.CONST})
_ONE_READ = UNARY | REDUCTIONS


class Instr(NamedTuple):
    """``op`` with destination register ``dst``, operands ``a``, ``b``, ``c`` (registers, or an
    input/output index for LOAD/STORE; -1 when unused) and ``imm`` (CONST's value). A named
    tuple: a program builds tens of them per region, in microseconds."""

    op: Op
    dst: int = -1
    a: int = -1
    b: int = -1
    c: int = -1
    imm: float = 0.0

    def __str__(self) -> str:
        if self.op is Op.LOAD:
            return f"r{self.dst} = load in{self.a}"
        if self.op is Op.CONST:
            return f"r{self.dst} = {self.imm!r}"
        if self.op is Op.STORE:
            return f"out{self.a} = store r{self.b}"
        args = ", ".join(f"r{x}" for x in (self.a, self.b, self.c) if x >= 0)
        return f"r{self.dst} = {self.op.name.lower()} {args}"


@dataclass(frozen=True)
class Program:
    """A straight-line program over ``n_regs`` registers, ``n_inputs`` inputs and
    ``n_outputs`` outputs (each STOREd exactly once)."""

    instrs: tuple[Instr, ...]
    n_inputs: int
    n_outputs: int
    n_regs: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "instrs", tuple(map(_instr, range(len(self.instrs)), self.instrs)))
        problems = []
        if not 0 < len(self.instrs) <= MAX_INSTRS:
            problems.append(f"{len(self.instrs)} instructions (1 to {MAX_INSTRS} allowed)")
        if not 0 <= self.n_inputs <= MAX_INPUTS:
            problems.append(f"{self.n_inputs} inputs (at most {MAX_INPUTS})")
        if not 0 < self.n_outputs <= MAX_OUTPUTS:
            problems.append(f"{self.n_outputs} outputs (1 to {MAX_OUTPUTS})")
        if not 0 < self.n_regs <= MAX_REGS:
            problems.append(f"{self.n_regs} registers (1 to {MAX_REGS})")
        written: set[int] = set()
        stored: list[int] = []
        for k, ins in enumerate(self.instrs):
            for r in reads(ins):
                if r not in written:
                    problems.append(f"instruction {k} ({ins}) reads r{r} before it is written")
            if ins.op is _LOAD and not 0 <= ins.a < self.n_inputs:
                problems.append(f"instruction {k} ({ins}) loads a missing input")
            if ins.op is _STORE:
                if not 0 <= ins.a < self.n_outputs:
                    problems.append(f"instruction {k} ({ins}) stores a missing output")
                stored.append(ins.a)
            elif not 0 <= ins.dst < self.n_regs:
                problems.append(f"instruction {k} ({ins}) writes outside r0..r{self.n_regs - 1}")
            else:
                written.add(ins.dst)
        if sorted(stored) != list(range(self.n_outputs)):
            need = f"each of 0..{self.n_outputs - 1} once"
            problems.append(f"outputs stored {sorted(stored)}, need {need}")
        if problems:
            raise ValueError("invalid dvm program: " + "; ".join(problems))

    @classmethod
    def built(
        cls, n_inputs: int, n_outputs: int, n_regs: int, encoded: tuple[list[int], list[float]]
    ) -> Program:
        """A program valid by construction (:class:`dvm.lower.Emitter`'s, or a valid one
        rewritten by :func:`dvm.vm.without_redundant_casts`), from its :meth:`encode` form:
        not checked again (the check costs more than building it), its ``instrs`` decoded
        when first read."""
        program = object.__new__(cls)
        vars(program).update(
            n_inputs=n_inputs, n_outputs=n_outputs, n_regs=n_regs, _encoded=encoded
        )
        return program

    def __getattr__(self, name: str) -> object:
        if name != "instrs" or "_encoded" not in vars(self):
            raise AttributeError(name)
        codes, imms = self._encoded
        instrs = tuple(
            Instr(Op(codes[k]), *codes[k + 1 : k + 5], imm)
            for k, imm in zip(range(0, len(codes), 5), imms, strict=True)
        )
        vars(self)["instrs"] = instrs
        return instrs

    @property
    def has_reduction(self) -> bool:
        return not REDUCTIONS.isdisjoint(self.encode()[0][::5])

    def encode(self) -> tuple[list[int], list[float]]:
        """The C++ VM's form: five int32 per instruction (op, dst, a, b, c), one float each."""
        encoded = vars(self).get("_encoded")
        if encoded is not None:
            return encoded
        codes = [v for ins in self.instrs for v in ins[:5]]
        return codes, [float(ins.imm) for ins in self.instrs]

    def disassemble(self) -> str:
        """One instruction per line, e.g. ``r2 = mul r0, r1``."""
        return "\n".join(str(ins) for ins in self.instrs)


def _instr(k: int, ins: object) -> Instr:
    """Instruction ``k`` as an :class:`Instr` whose ``op`` is an :class:`Op` (a plain tuple or
    an int opcode, as a user may write them, is converted)."""
    if type(ins) is Instr and type(ins.op) is Op:
        return ins
    try:
        given = Instr(*ins)  # type: ignore[misc]
        return given._replace(op=Op(given.op))
    except (TypeError, ValueError):
        raise ValueError(
            f"invalid dvm program: instruction {k} is {ins!r}; give an Instr(op, dst, a, b, c, "
            f"imm) whose op is a dvm.program.Op"
        ) from None


def reads(ins: Instr) -> tuple[int, ...]:
    """The registers ``ins`` reads."""
    return read_registers(ins.op, ins.a, ins.b, ins.c)


def read_registers(op: int, a: int, b: int, c: int) -> tuple[int, ...]:
    """The registers an instruction ``op`` with operands ``a``, ``b``, ``c`` reads (the
    encoded form's fields)."""
    if op in _NO_READS:
        return ()
    if op == _STORE:
        return (b,)
    if op in _ONE_READ:
        return (a,)
    if op in BINARY:
        return (a, b)
    return (a, b, c)


def output_shape(domain: tuple[int, ...], reduced: bool) -> tuple[int, ...]:
    """An output's shape: the domain's, or with the row reduced to 1."""
    return (*domain[:-1], 1) if reduced else tuple(domain)


_UNARY_TORCH = {
    Op.NEG: torch.neg,
    Op.ABS: torch.abs,
    Op.EXP: torch.exp,
    Op.LOG: torch.log,
    Op.LOG1P: torch.log1p,
    Op.SQRT: torch.sqrt,
    Op.RSQRT: torch.rsqrt,
    Op.RECIPROCAL: torch.reciprocal,
    Op.TANH: torch.tanh,
    Op.SIGMOID: torch.sigmoid,
    Op.ERF: torch.erf,
    Op.SIN: torch.sin,
    Op.COS: torch.cos,
    Op.NOT: lambda a: (a == 0).float(),
    Op.CAST_BF16: lambda a: a.bfloat16().float(),
    Op.CAST_F16: lambda a: a.half().float(),
    Op.GELU: torch.nn.functional.gelu,
}
# Evaluated in float64 and rounded once to fp32: the correctly rounded value the VM's ulp bounds
# are stated against, and independent of torch's own fp32 kernels (whose first exp call in a
# process has been seen to return values 1.5e-4 off on this CPU).
_IN_FLOAT64 = {
    Op.EXP, Op.LOG, Op.LOG1P, Op.TANH, Op.SIGMOID, Op.ERF, Op.SIN, Op.COS, Op.POW, Op.GELU
}  # fmt: skip
_BINARY_TORCH = {
    Op.ADD: torch.add,
    Op.SUB: torch.sub,
    Op.MUL: torch.mul,
    Op.DIV: torch.div,
    Op.POW: torch.pow,
    Op.MAX: torch.maximum,
    Op.MIN: torch.minimum,
    Op.EQ: lambda a, b: (a == b).float(),
    Op.NE: lambda a, b: (a != b).float(),
    Op.LT: lambda a, b: (a < b).float(),
    Op.LE: lambda a, b: (a <= b).float(),
    Op.GT: lambda a, b: (a > b).float(),
    Op.GE: lambda a, b: (a >= b).float(),
    Op.AND: lambda a, b: ((a != 0) & (b != 0)).float(),
    Op.OR: lambda a, b: ((a != 0) | (b != 0)).float(),
}
_REDUCE_TORCH = {
    Op.REDUCE_SUM: lambda a: a.sum(-1, keepdim=True),
    Op.REDUCE_MAX: lambda a: a.amax(-1, keepdim=True),
    Op.REDUCE_MEAN: lambda a: a.mean(-1, keepdim=True),
}


def run_reference(
    program: Program,
    inputs: list[torch.Tensor],
    domain: tuple[int, ...],
    out_dtypes: list[torch.dtype],
    reduced: list[bool] | None = None,
) -> list[torch.Tensor]:
    """What the VM computes, in plain PyTorch (the tests' oracle): fp32 registers over the
    domain; outputs of ``out_dtypes``, row-reduced where ``reduced`` says so."""
    reduced = reduced or [False] * program.n_outputs
    regs: dict[int, torch.Tensor] = {}
    outs: list[torch.Tensor | None] = [None] * program.n_outputs
    for ins in program.instrs:
        if ins.op is Op.LOAD:
            value = torch.broadcast_to(inputs[ins.a].float(), domain)
        elif ins.op is Op.CONST:
            value = torch.full(domain, ins.imm, dtype=torch.float32)
        elif ins.op is Op.STORE:
            v = regs[ins.b]
            outs[ins.a] = (v[..., :1] if reduced[ins.a] else v).to(out_dtypes[ins.a]).contiguous()
            continue
        elif ins.op in _UNARY_TORCH or ins.op in _BINARY_TORCH:
            fn = _UNARY_TORCH.get(ins.op) or _BINARY_TORCH[ins.op]
            args = [regs[ins.a]] if ins.op in _UNARY_TORCH else [regs[ins.a], regs[ins.b]]
            value = fn(*(a.double() if ins.op in _IN_FLOAT64 else a for a in args))
        elif ins.op is Op.WHERE:
            value = torch.where(regs[ins.a] != 0, regs[ins.b], regs[ins.c])
        else:
            value = torch.broadcast_to(_REDUCE_TORCH[ins.op](regs[ins.a]), domain)
        regs[ins.dst] = value.float()
    return [o for o in outs if o is not None]
