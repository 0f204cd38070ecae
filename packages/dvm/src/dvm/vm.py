"""Runs :class:`~dvm.program.Program` s on the C++ VM, with the semantics of
:func:`dvm.program.run_reference`.

``run(program, inputs, domain, out_dtypes)`` is the one-shot form; :class:`Kernel` encodes a
program once and is then called per batch of inputs, which keeps the per-call cost to
checking the inputs, allocating the outputs and one ctypes call; :meth:`Kernel.bind` fixes the
domain and the operands' shapes and dtypes too (a compiled region's guarded signature), leaving
a call only the strides, the outputs and the ctypes call. Inputs are read in place through their
strides over the domain (broadcast and strided views need no copies).
"""

from __future__ import annotations

import ctypes
import operator
from array import array
from collections.abc import Sequence
from typing import Any

import torch

from dvm import _lib
from dvm.program import DTYPE_CODES, MAX_DIMS, Instr, Op, Program, output_shape, reads

__all__ = ["Kernel", "Launch", "VMError", "run", "without_redundant_casts"]


class VMError(RuntimeError):
    """The VM refused a call it cannot run (a limit it has, or a status from the C++ side)."""


_STATUS = {
    1: "the encoded program is invalid",
    2: "invalid domain, strides or data pointers",
    3: "an operand has a dtype the VM does not take",
    4: "a reducing program's rows are too long",
    5: "no memory for the VM's registers",
}
_PTR = ctypes.c_void_p
_CPU = torch.device("cpu")


def _buffer(typecode: str, values: Sequence[Any]) -> tuple[array, int]:
    """``values`` in a C array (``array.array``, typecode ``i`` int32, ``q`` int64, ``f`` float,
    ``Q`` a pointer) and the address of its first element, for ``dvm_run`` (as a ``c_void_p``);
    keep the array while the address is used. Not a ctypes array: ctypes makes an array type for
    each length, which took 10-40 µs right after tracing (a compile's case), as much as the rest
    of a runner."""
    buf = array(typecode, values)
    return buf, buf.buffer_info()[0]


_DTYPES = ", ".join(str(d).removeprefix("torch.") for d in DTYPE_CODES)


_ROUNDS_TO = {Op.CAST_BF16: torch.bfloat16, Op.CAST_F16: torch.float16}
_CASTS = frozenset(_ROUNDS_TO)


def without_redundant_casts(program: Program, out_dtypes: Sequence[torch.dtype]) -> Program:
    """``program`` less each CAST_BF16/CAST_F16 stored at once into an output of that dtype
    and not read again: the store rounds the same way (rounding twice to a 16-bit type equals
    rounding once), so the cast's pass over the tile is redundant."""
    instrs = program.instrs
    drop: set[int] = set()
    store_from: dict[int, int] = {}  # store index -> register it stores instead
    for k in range(len(instrs) - 1):
        cast, store = instrs[k], instrs[k + 1]
        if (
            _ROUNDS_TO.get(cast.op) is None
            or store.op is not Op.STORE
            or store.b != cast.dst
            or out_dtypes[store.a] != _ROUNDS_TO[cast.op]
            or _read_before_written(instrs[k + 2 :], cast.dst)
        ):
            continue
        drop.add(k)
        store_from[k + 1] = cast.a
    if not drop:
        return program
    kept = tuple(
        ins._replace(b=store_from[k]) if k in store_from else ins
        for k, ins in enumerate(instrs)
        if k not in drop
    )
    return Program(kept, program.n_inputs, program.n_outputs, program.n_regs)


def _read_before_written(instrs: Sequence[Instr], reg: int) -> bool:
    for ins in instrs:
        if reg in reads(ins):
            return True
        if ins.op is not Op.STORE and ins.dst == reg:
            return False
    return False


def _dtype_code(dtype: torch.dtype, what: str, k: int) -> int:
    code = DTYPE_CODES.get(dtype)
    if code is None:
        raise TypeError(f"{what} {k} has dtype {dtype}; the VM takes {_DTYPES}: cast it first")
    return code


def _check_resolved(t: torch.Tensor, what: str, k: int) -> None:
    """A lazily negated view (``z.conj().imag``) holds the values' negatives in memory, which
    the VM would read as they are."""
    if t.is_neg():
        raise ValueError(
            f"{what} {k} is a lazily negated view (e.g. z.conj().imag): pass t.resolve_neg()"
        )


def _strides(t: torch.Tensor, domain: tuple[int, ...], k: int) -> list[int]:
    """``t``'s element strides over ``domain`` (0 along broadcast dimensions)."""
    picks = _stride_map(t.shape, t.shape, domain, k)
    strides = t.stride()
    return list(strides) if picks is None else [strides[j] if j >= 0 else 0 for j in picks]


def _domain(domain: Sequence[int]) -> tuple[int, ...]:
    if type(domain) is torch.Size and 1 <= len(domain) <= MAX_DIMS:
        return domain
    try:
        dims = tuple(operator.index(d) for d in domain)  # a float size is an error, not truncated
    except TypeError:
        raise TypeError(f"domain must be a sequence of ints, got {domain!r}") from None
    if not 1 <= len(dims) <= MAX_DIMS or min(dims) < 0:
        raise ValueError(f"domain {dims}: need 1 to {MAX_DIMS} non-negative sizes")
    return dims


def _layouts(
    out_strides: Sequence[Sequence[int] | None] | None,
    dims: tuple[int, ...],
    reduced: tuple[bool, ...],
) -> Sequence[tuple[int, ...] | None]:
    """Each output's strides (``None``: contiguous), checked dense and non-overlapping."""
    if out_strides is None:
        return (None,) * len(reduced)
    if len(out_strides) != len(reduced):
        raise ValueError(f"out_strides: give one entry per output ({len(reduced)})")
    layouts = []
    for k, (strides, red) in enumerate(zip(out_strides, reduced, strict=True)):
        if strides is None:
            layouts.append(None)
            continue
        strides = tuple(map(int, strides))
        if red or len(strides) != len(dims):
            raise ValueError(
                f"out_strides[{k}] = {strides}: give {len(dims)} strides for a non-reduced "
                "output, or None"
            )
        expect = 0 if 0 in dims else 1
        for size, stride in sorted(zip(dims, strides, strict=True), key=lambda p: p[1]):
            if size > 1 and expect and stride != expect:
                raise ValueError(
                    f"out_strides[{k}] = {strides} is not a dense, non-overlapping layout of {dims}"
                )
            expect *= size
        layouts.append(strides)
    return layouts


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
        reduced = [False] * n_out if reduced is None else [bool(r) for r in reduced]
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
        self.reduced = tuple(reduced)
        out_codes = [_dtype_code(d, "output", k) for k, d in enumerate(out_dtypes)]
        if isa is None:
            self._lib, self.isa = _lib.library()
        else:
            self._lib, self.isa = _lib.load(isa), isa
        self._max_row = _lib.max_row(self.isa) if program.has_reduction else None
        n_in = program.n_inputs
        # the call's fixed arguments (their arrays kept alive in _buffers)
        (codes_buf, codes_at), (imms_buf, imms_at) = _buffer("i", codes), _buffer("f", imms)
        out_codes_buf, out_codes_at = _buffer("i", out_codes)
        self._buffers = (codes_buf, imms_buf, out_codes_buf)
        self._head = (_PTR(codes_at), _PTR(imms_at), len(codes) // 5, program.n_regs, n_in)
        self._out_codes = _PTR(out_codes_at)

    def _check_rows(self, dims: tuple[int, ...]) -> None:
        if self._max_row is None:
            return
        if dims[-1] > self._max_row:
            raise VMError(
                f"rows of {dims[-1]} elements: the VM reduces rows of at most "
                f"{self._max_row} (run this region eagerly)"
            )
        if dims[-1] == 0 and 0 not in dims[:-1] and any(self.reduced):
            raise VMError(
                "rows of 0 elements: a row-reduced output has no value for an empty row "
                "(eager's sum gives 0, amax raises); run it eagerly"
            )

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
        return Launch(self, _domain(domain), args, operands, out_shapes, out_strides)

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
        dims = _domain(domain)
        n_in = self._head[4]
        if len(inputs) != n_in:
            raise ValueError(f"the program takes {n_in} inputs, got {len(inputs)}")
        layouts = _layouts(out_strides, dims, self.reduced)
        self._check_rows(dims)
        threads = torch.get_num_threads() if threads is None else int(threads)
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        in_codes = []
        longs: list[int] = []  # input strides, output strides, the domain: one int64 array
        for k, t in enumerate(inputs):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"input {k} is a {type(t).__name__}, not a torch.Tensor")
            if not t.is_cpu or t.layout is not torch.strided:
                raise ValueError(
                    f"input {k} is a {t.device.type} {t.layout} tensor; the VM runs on dense "
                    f"CPU tensors (move it with .cpu())"
                )
            _check_resolved(t, "input", k)
            code = DTYPE_CODES.get(t.dtype)
            if code is None:
                _dtype_code(t.dtype, "input", k)
            in_codes.append(code)
            longs += t.stride() if t.shape == dims else _strides(t, dims, k)
        outs = []
        for dtype, red, layout in zip(self.out_dtypes, self.reduced, layouts, strict=True):
            if layout is None:
                out = torch.empty(output_shape(dims, red), dtype=dtype, device=_CPU)
            else:
                out = torch.empty_strided(dims, layout, dtype=dtype, device=_CPU)
            longs += out.stride()
            if red:
                longs[-1] = 0  # every column of a row maps to the row's one element
            outs.append(out)
        longs += dims
        ptrs = [t.data_ptr() for t in inputs] + [o.data_ptr() for o in outs]
        _alive, in_codes_at = _buffer("i", in_codes)  # the array stays alive through the call
        self._run(ptrs, _PTR(in_codes_at), longs, len(dims), min(threads, 2**31 - 1))
        return outs

    def _run(
        self, ptrs: list[int], in_codes: ctypes.c_void_p, longs: list[int], nd: int, threads: int
    ) -> None:
        """One ``dvm_run``: data pointers (inputs then outputs), input dtype codes, strides
        (inputs then outputs) then the domain; :class:`VMError` when the VM refuses."""
        n_in = self._head[4]
        _ints, at = _buffer("q", longs)  # the arrays stay alive through the call
        _pointers, ptrs_at = _buffer("Q", ptrs)
        status = self._lib.dvm_run(
            *self._head,
            _PTR(ptrs_at),
            in_codes,
            _PTR(at),
            len(self.out_dtypes),
            _PTR(ptrs_at + 8 * n_in),
            self._out_codes,
            _PTR(at + 8 * n_in * nd),
            _PTR(at + 8 * (len(longs) - nd)),
            nd,
            threads,
        )
        if status != 0:
            raise VMError(f"dvm_run refused the call: {_STATUS.get(status, f'status {status}')}")


def _contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return strides[::-1]


def _stride_map(
    shape: Sequence[int], view: Sequence[int], dims: tuple[int, ...], k: int
) -> tuple[int, ...] | None:
    """For each dim of ``dims``, the dim of a tensor of ``shape`` whose stride it takes (-1:
    stride 0, a broadcast or size-1 dim), the tensor seen as ``view``; ``None`` when the
    tensor's own strides are those over the domain (its shape is the domain's)."""
    if [s for s in shape if s != 1] != [s for s in view if s != 1]:
        raise ValueError(f"input {k}: view {tuple(view)} of {tuple(shape)} moves elements")
    if tuple(shape) == dims:
        return None
    pad = len(dims) - len(view)
    if pad < 0:
        raise ValueError(f"input {k} has {len(view)} dims, more than the domain {dims}")
    own = iter(j for j, s in enumerate(shape) if s != 1)
    picks = [-1] * pad
    for size, want in zip(view, dims[pad:], strict=True):
        if size != want and size != 1:
            raise ValueError(
                f"input {k} of shape {tuple(view)} does not broadcast to the domain {dims}"
            )
        picks.append(next(own) if size != 1 else -1)
    return tuple(picks)


class Launch:
    """A :class:`Kernel` bound to one domain and to its operands' shapes and dtypes (see
    :meth:`Kernel.bind`). Call it with dense CPU tensors of exactly those shapes and dtypes; it
    returns the outputs. A call with others raises ``ValueError`` / ``TypeError``, and a row
    too long for a reducing program :class:`VMError`, at each call."""

    def __init__(
        self,
        kernel: Kernel,
        dims: tuple[int, ...],
        args: Sequence[torch.Tensor],
        operands: Sequence[tuple[int, Sequence[int]]],
        out_shapes: Sequence[Sequence[int]],
        out_strides: Sequence[Sequence[int] | None] | None,
    ) -> None:
        n_in, n_out = kernel._head[4], len(kernel.out_dtypes)
        if len(operands) != n_in or len(out_shapes) != n_out:
            raise ValueError(
                f"the program takes {n_in} inputs and {n_out} outputs, got {len(operands)} "
                f"operands and {len(out_shapes)} output shapes"
            )
        try:
            kernel._check_rows(dims)
        except VMError as e:
            self._refused: VMError | None = e
        else:
            self._refused = None
        self._kernel = kernel
        self._signature = tuple((tuple(a.shape), a.dtype) for a in args)
        self._operands = tuple(
            (i, _stride_map(args[i].shape, view, dims, k)) for k, (i, view) in enumerate(operands)
        )
        self._in_codes_buf, in_codes_at = _buffer(
            "i", [_dtype_code(args[i].dtype, "input", k) for k, (i, _) in enumerate(operands)]
        )
        self._in_codes = _PTR(in_codes_at)
        layouts = _layouts(out_strides, dims, kernel.reduced)
        self._allocs = []
        tail: list[int] = []
        for k, (shape, dtype, red, layout) in enumerate(
            zip(out_shapes, kernel.out_dtypes, kernel.reduced, layouts, strict=True)
        ):
            want = output_shape(dims, red)
            if [s for s in shape if s != 1] != [s for s in want if s != 1]:
                raise ValueError(f"output {k}: shape {tuple(shape)} is not {want} (up to 1s)")
            if layout is None:
                strides = _contiguous_strides(want)
                self._allocs.append((tuple(shape), tuple(_contiguous_strides(shape)), dtype))
            else:  # allocated in `shape`, its dims other than 1 laid out as the domain's
                strides = list(layout)
                own = iter(st for size, st in zip(dims, layout, strict=True) if size != 1)
                placed = tuple(next(own) if size != 1 else 1 for size in shape)
                self._allocs.append((tuple(shape), placed, dtype))
            if red:
                strides[-1] = 0
            tail += strides
        self._tail = tail + list(dims)
        self._nd = len(dims)

    def __call__(self, args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if len(args) != len(self._signature):
            raise ValueError(f"bound for {len(self._signature)} args, got {len(args)}")
        for k, (t, (shape, dtype)) in enumerate(zip(args, self._signature, strict=True)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"arg {k} is a {type(t).__name__}, not a torch.Tensor")
            if t.shape != shape or t.dtype != dtype:
                raise ValueError(
                    f"arg {k} is {t.dtype} {tuple(t.shape)}; this launch was bound for {dtype} "
                    f"{shape} (bind the kernel again for other shapes or dtypes)"
                )
            if not t.is_cpu or t.layout is not torch.strided:
                raise ValueError(
                    f"arg {k} is a {t.device.type} {t.layout} tensor; the VM runs on dense CPU "
                    f"tensors (move it with .cpu())"
                )
            _check_resolved(t, "arg", k)
        return self.call_unchecked(args)

    def call_unchecked(self, args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """:meth:`__call__` without the argument checks, for callers that made them (a compiled
        region's guard): other args read out of bounds."""
        if self._refused is not None:
            raise self._refused
        longs: list[int] = []
        for i, picks in self._operands:
            strides = args[i].stride()
            longs += strides if picks is None else [strides[j] if j >= 0 else 0 for j in picks]
        # empty_strided: torch.empty parses a shape 1-3 µs slower a call; on the CPU whatever
        # the default device (a CUDA one would hand the VM device pointers)
        outs = [torch.empty_strided(s, st, dtype=d, device=_CPU) for s, st, d in self._allocs]
        longs += self._tail
        ptrs = [args[i].data_ptr() for i, _ in self._operands] + [o.data_ptr() for o in outs]
        self._kernel._run(ptrs, self._in_codes, longs, self._nd, torch.get_num_threads())
        return outs


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
