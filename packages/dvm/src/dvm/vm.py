"""Runs :class:`~dvm.program.Program` s on the C++ VM, with the semantics of
:func:`dvm.program.run_reference`.

``run(program, inputs, domain, out_dtypes)`` is the one-shot form; :class:`Kernel` encodes a
program once and is then called per batch of inputs; :meth:`Kernel.bind` fixes the domain and
the operands' shapes and dtypes too (a compiled region's guarded signature) in a
:class:`Launch`. The binding and the calls run in C (``dvm._launcher``): binding checks the
domain, operands and output layouts and works out each operand's strides over the domain; a
call checks the args, reads their strides and data pointers, allocates the outputs and calls
the VM, without Python code or ctypes in between. Inputs are read in place through their
strides over the domain (broadcast and strided views need no copies).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dvm import _launcher, _lib
from dvm.program import DTYPE_CODES, Op, Program, read_registers

__all__ = ["MISMATCH", "Kernel", "Launch", "VMError", "run", "without_redundant_casts"]


class VMError(RuntimeError):
    """The VM refused a call it cannot run (a limit it has, or a status from the C++ side)."""


_STATUS = {
    1: "the encoded program is invalid",
    2: "invalid domain, strides or data pointers",
    3: "an operand has a dtype the VM does not take",
    4: "a reducing program's rows are too long",
    5: "no memory for the VM's registers",
}
_DTYPES = ", ".join(str(d).removeprefix("torch.") for d in DTYPE_CODES)
_launcher.setup(
    torch.Tensor,  # with nn.Parameter, the types whose args a launch takes (not subclasses)
    torch.nn.Parameter,
    torch.empty_strided,  # torch.empty parses a shape 1-3 µs slower a call
    # outputs on the CPU whatever the default device: a CUDA one would hand the VM its pointers
    torch.device("cpu"),
    torch.get_num_threads,
    torch.is_grad_enabled,
    torch.strided,
    VMError,
    _STATUS,
    DTYPE_CODES,
    _DTYPES,
    # torch function handling off while a call reads its args and runs, where a mode is on: a
    # TorchFunctionMode would see those reads and could misstate a plain tensor's memory
    torch._C._is_torch_function_mode_enabled,
    torch._C.DisableTorchFunction,
)


_ROUNDS_TO = {Op.CAST_BF16: torch.bfloat16, Op.CAST_F16: torch.float16}
_CASTS = frozenset(_ROUNDS_TO)
_STORE = Op.STORE  # bound once: an enum attribute lookup costs ~1 µs


def without_redundant_casts(program: Program, out_dtypes: Sequence[torch.dtype]) -> Program:
    """``program`` less each CAST_BF16/CAST_F16 stored at once into an output of that dtype
    and not read again: the store rounds the same way (rounding twice to a 16-bit type equals
    rounding once), so the cast's pass over the tile is redundant. Worked on the encoded form
    (five ints an instruction); the result is valid as ``program`` is: the store reads the
    cast's operand, unchanged in between."""
    codes, imms = program.encode()
    drop: set[int] = set()  # instruction numbers
    store_from: dict[int, int] = {}  # a store's number -> the register it stores instead
    for k in range(len(imms) - 1):
        cast, store = 5 * k, 5 * k + 5
        rounds = _ROUNDS_TO.get(codes[cast])
        if (
            rounds is None
            or codes[store] != _STORE
            or codes[store + 3] != codes[cast + 1]
            or out_dtypes[codes[store + 2]] != rounds
            or _read_before_written(codes, k + 2, codes[cast + 1])
        ):
            continue
        drop.add(k)
        store_from[k + 1] = codes[cast + 2]
    if not drop:
        return program
    kept: list[int] = []
    for k in range(len(imms)):
        if k not in drop:
            kept += codes[5 * k : 5 * k + 5]
            if k in store_from:
                kept[-2] = store_from[k]
    kept_imms = [imm for k, imm in enumerate(imms) if k not in drop]
    return Program.built(program.n_inputs, program.n_outputs, program.n_regs, (kept, kept_imms))


def _read_before_written(codes: Sequence[int], start: int, reg: int) -> bool:
    """Whether an encoded instruction from number ``start`` on reads ``reg`` before one
    writes it."""
    for k in range(5 * start, len(codes), 5):
        if reg in read_registers(codes[k], *codes[k + 2 : k + 5]):
            return True
        if codes[k] != _STORE and codes[k + 1] == reg:
            return False
    return False


def _negated(what: str, k: int) -> ValueError:
    """The error for a lazily negated view (``z.conj().imag``): it holds the values' negatives
    in memory, which the VM would read as they are."""
    return ValueError(
        f"{what} {k} is a lazily negated view (e.g. z.conj().imag): pass t.resolve_neg()"
    )


class Kernel:
    """``program`` encoded for the VM once, producing outputs of ``out_dtypes`` (row-reduced
    where ``reduced`` says so); call it with inputs and a domain. ``isa`` picks a build
    (``v4``, ``v3``, ``base``) instead of ``DVM_ISA`` or the best one."""

    def __init__(
        self,
        program: Program,
        out_dtypes: Sequence[torch.dtype],
        reduced: Sequence[bool] | None = None,
        *,
        isa: str | None = None,
    ) -> None:
        if not isinstance(program, Program):
            raise TypeError(f"program must be a dvm.program.Program, got {type(program).__name__}")
        n_out = program.n_outputs
        reduced = (False,) * n_out if reduced is None else tuple(map(bool, reduced))
        if len(out_dtypes) != n_out or len(reduced) != n_out:
            raise ValueError(
                f"the program has {n_out} outputs: give {n_out} out_dtypes and reduced flags "
                f"(got {len(out_dtypes)} and {len(reduced)})"
            )
        codes, imms = program.encode()
        if not _CASTS.isdisjoint(codes[::5]):
            codes, imms = without_redundant_casts(program, out_dtypes).encode()
        self.program = program
        self.out_dtypes = tuple(out_dtypes)
        self.reduced = reduced
        for k, dtype in enumerate(self.out_dtypes):
            if dtype not in DTYPE_CODES:
                raise TypeError(
                    f"output {k} has dtype {dtype}; the VM takes {_DTYPES}: cast it first"
                )
        if isa is None:
            self.isa = _lib.library()[1]
        else:
            _lib.load(isa)
            self.isa = isa
        self._max_row = _lib.max_row(self.isa) if program.has_reduction else None
        self._run_at = _lib.run_address(self.isa)
        self._code, self._imm = codes, imms

    def bind(
        self,
        domain: Sequence[int],
        args: Sequence[torch.Tensor],
        operands: Sequence[tuple[int, Sequence[int]]],
        out_shapes: Sequence[Sequence[int]],
        *,
        out_strides: Sequence[Sequence[int] | None] | None = None,
    ) -> Launch:
        """This kernel for calls whose ``args`` have the shapes and dtypes of the examples
        ``args`` (real or fake tensors): operand ``k`` is ``args[i]`` seen with shape ``view``
        for ``operands[k] = (i, view)`` (``view`` differs from the arg's shape only in size-1
        dims, and broadcasts to ``domain``); output ``k`` is allocated with ``out_shapes[k]``
        (the output's shape over the domain, up to size-1 dims), contiguous or, with
        ``out_strides[k]`` over the domain as in :meth:`__call__`, laid out as that says."""
        return Launch(self, domain, args, operands, out_shapes, out_strides)

    def __call__(
        self,
        inputs: Sequence[torch.Tensor],
        domain: Sequence[int],
        *,
        threads: int | None = None,
        out_strides: Sequence[Sequence[int] | None] | None = None,
    ) -> list[torch.Tensor]:
        """The program's outputs over ``domain`` for ``inputs`` (CPU tensors broadcastable to
        it), on ``threads`` threads (default ``torch.get_num_threads()``). Outputs are
        contiguous unless ``out_strides[i]`` gives a non-reduced output's strides over the
        domain (a dense, non-overlapping layout such as a permutation)."""
        n_in = self.program.n_inputs
        if len(inputs) != n_in:
            raise ValueError(f"the program takes {n_in} inputs, got {len(inputs)}")
        threads = torch.get_num_threads() if threads is None else int(threads)
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        for k, t in enumerate(inputs):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"input {k} is a {type(t).__name__}, not a torch.Tensor")
            if not t.is_cpu or t.layout is not torch.strided:
                raise ValueError(
                    f"input {k} is a {t.device.type} {t.layout} tensor; the VM runs on dense "
                    f"CPU tensors (move it with .cpu())"
                )
            if t.is_neg():
                raise _negated("input", k)
        launch = Launch(
            self, domain, inputs, [(k, t.shape) for k, t in enumerate(inputs)], None, out_strides
        )
        return launch.run(inputs, threads)


class Launch:
    """A :class:`Kernel` bound to one domain and to its operands' shapes and dtypes (see
    :meth:`Kernel.bind`). Call it with dense CPU tensors of exactly those shapes and dtypes; it
    returns the outputs. A call with others raises ``ValueError`` / ``TypeError``, and a row
    too long for a reducing program :class:`VMError`, at each call.

    The binding and the calls run in C (``dvm._launcher.Launcher``, whose ``shapes`` and
    ``dtypes`` are the args' as bound): ``run(args, threads=0)`` (the outputs;
    ``threads`` below 1 means ``torch.get_num_threads()``), ``mismatch(args, grad)`` (the
    first arg that cannot run as bound, ``(k, kind)`` with ``kind`` an index into
    :data:`MISMATCH`, or ``None``; with ``grad``, an arg requiring grad counts) and
    ``guarded(args, results)`` (``None`` when ``mismatch(args, torch.is_grad_enabled())``
    finds one, else the tuple of ``outputs[k]``, or ``outputs[k].view(shape)``, for each
    ``(k, shape or None)`` of ``results``: a compiled region's call)."""

    def __init__(
        self,
        kernel: Kernel,
        domain: Sequence[int],
        args: Sequence[torch.Tensor],
        operands: Sequence[tuple[int, Sequence[int]]],
        out_shapes: Sequence[Sequence[int]] | None,
        out_strides: Sequence[Sequence[int] | None] | None,
    ) -> None:
        program = kernel.program
        launcher = _launcher.Launcher(
            kernel._run_at,
            kernel._code,
            kernel._imm,
            program.n_regs,
            program.n_inputs,
            kernel.out_dtypes,
            kernel.reduced,
            kernel._max_row,
            domain,
            args,
            operands,
            out_shapes,
            out_strides,
        )
        self._launcher = launcher
        self.run, self.mismatch, self.guarded = launcher.run, launcher.mismatch, launcher.guarded

    def __call__(self, args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        args = tuple(args)  # an iterator is read once
        found = self.mismatch(args, False)
        if found is not None:
            k, kind = found
            bound = self._launcher.shapes[k], self._launcher.dtypes[k]
            raise _mismatch_error(args[k], k, MISMATCH[kind], bound)
        return self.run(args)


MISMATCH: tuple[str, ...] = _launcher.MISMATCH
"""The kinds of arg :meth:`Launch.mismatch` reports, by index: ``"not a tensor"``,
``"shape"``, ``"dtype"``, ``"device"`` (or layout), ``"negated"`` (a lazily negated view),
``"needs grad"``, ``"a tensor subclass"`` (other than ``nn.Parameter``: its own methods could
misstate its strides or memory, which the VM reads directly)."""


def _mismatch_error(t: Any, k: int, kind: str, bound: tuple[torch.Size, torch.dtype]) -> Exception:
    """The error for arg ``k``, ``t``, which does not match ``bound`` (shape, dtype) by ``kind``."""
    if kind == "not a tensor":
        return TypeError(f"arg {k} is a {type(t).__name__}, not a torch.Tensor")
    if kind == "a tensor subclass":
        return TypeError(
            f"arg {k} is a {type(t).__name__}, a torch.Tensor subclass; the VM takes plain "
            f"tensors and nn.Parameters (pass t.as_subclass(torch.Tensor))"
        )
    if kind in ("shape", "dtype"):
        shape, dtype = bound
        return ValueError(
            f"arg {k} is {t.dtype} {tuple(t.shape)}; this launch was bound for {dtype} "
            f"{tuple(shape)} (bind the kernel again for other shapes or dtypes)"
        )
    if kind == "device":
        return ValueError(
            f"arg {k} is a {t.device.type} {t.layout} tensor; the VM runs on dense CPU "
            f"tensors (move it with .cpu())"
        )
    return _negated("arg", k)


def run(
    program: Program,
    inputs: Sequence[torch.Tensor],
    domain: Sequence[int],
    out_dtypes: Sequence[torch.dtype],
    reduced: Sequence[bool] | None = None,
    *,
    threads: int | None = None,
) -> list[torch.Tensor]:
    """``program``'s outputs over ``domain``, as :func:`dvm.program.run_reference` computes
    them, on the C++ VM (``threads`` default ``torch.get_num_threads()``)."""
    return Kernel(program, out_dtypes, reduced)(inputs, domain, threads=threads)
