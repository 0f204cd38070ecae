"""dvm._launcher, the C side of a bound launch: its guard agrees with the runner's reasons,
bad construction and calls raise, and a call keeps no references it should not."""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch

from dvm import _launcher, vm
from dvm.compile import _guard_failure
from dvm.program import Instr, Op, Program

SIZE = torch.Size((4, 6))


def _launch() -> vm.Launch:
    p = Program(
        (
            Instr(Op.LOAD, 0, 0),
            Instr(Op.LOAD, 1, 1),
            Instr(Op.MUL, 2, 0, 1),
            Instr(Op.STORE, -1, 0, 2),
        ),
        2,
        1,
        3,
    )
    x, w = torch.randn(SIZE), torch.randn(6)
    return vm.Kernel(p, [torch.float32]).bind(SIZE, [x, w], [(0, SIZE), (1, (6,))], [SIZE])


class _LyingStride(torch.Tensor):
    """A tensor subclass whose own stride() misstates its memory: were it believed, the VM
    would read far beyond the tensor."""

    def stride(self, *dim):
        return (2**40, 1)


ARGS = {
    "ok": lambda: (torch.randn(SIZE), torch.randn(6)),
    "not a tensor": lambda: (torch.randn(SIZE), 2.0),
    "shape": lambda: (torch.randn(4, 7), torch.randn(6)),
    "dtype": lambda: (torch.randn(SIZE, dtype=torch.float64), torch.randn(6)),
    "device": lambda: (torch.randn(SIZE).to_sparse(), torch.randn(6)),
    "meta": lambda: (torch.randn(SIZE), torch.empty(6, device="meta")),
    "negated": lambda: (torch.randn(SIZE), torch.randn(6, dtype=torch.complex64).conj().imag),
    "needs grad": lambda: (torch.randn(SIZE, requires_grad=True), torch.randn(6)),
    "a tensor subclass": lambda: (torch.randn(SIZE).as_subclass(_LyingStride), torch.randn(6)),
    "parameter": lambda: (
        torch.nn.Parameter(torch.randn(SIZE), requires_grad=False),
        torch.randn(6),
    ),
}


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("case", list(ARGS))
def test_the_c_guard_refuses_exactly_what_the_runner_gives_a_reason_for(case, grad):
    launch = _launch()
    args = ARGS[case]()
    guards = [(SIZE, torch.float32), (torch.Size((6,)), torch.float32)]
    with torch.set_grad_enabled(grad):
        reason = _guard_failure(args, guards)
        found = launch.mismatch(args, grad)
        got = launch.guarded(args, ((0, None),))
    assert (found is None) == (reason is None) == (got is not None)
    if case in ("ok", "parameter") or (case == "needs grad" and not grad):
        torch.testing.assert_close(got[0], args[0] * args[1])
    else:
        k, kind = found
        kinds = {"meta": "device", "needs grad": "needs grad"}
        assert vm.MISMATCH[kind] == kinds.get(case, case)
        assert reason.startswith(f"input {k} ")


def test_results_are_views_where_asked_and_a_call_keeps_no_references():
    launch = _launch()
    x, w = ARGS["ok"]()
    refs = sys.getrefcount(x), sys.getrefcount(w)
    for _ in range(100):
        out, view = launch.guarded([x, w], ((0, None), (0, torch.Size((24,)))))
    assert (sys.getrefcount(x), sys.getrefcount(w)) == refs
    assert view.shape == (24,)
    assert view._base is out
    assert sys.getrefcount(out) == 3  # out, the view's base, getrefcount's argument
    assert torch.equal(out, x * w)


def test_calls_with_wrong_args_raise():
    launch = _launch()
    x, w = ARGS["ok"]()
    with pytest.raises(ValueError, match="bound for 2 args, got 1"):
        launch.run([x])
    with pytest.raises(TypeError, match="sequence"):
        launch.run(5)
    with pytest.raises(ValueError, match="does not match the launch"):
        launch.run([x, w.double()])  # Launch's own call explains; run refuses all the same
    with pytest.raises(ValueError, match=r"arg 1 is torch.float64 \(6,\); .*bound for"):
        launch([x, w.double()])
    with pytest.raises(TypeError, match="results"):
        launch.guarded([x, w], ((0,),))
    with pytest.raises(ValueError, match="no such output"):
        launch.guarded([x, w], ((1, None),))
    assert torch.equal(launch.run([x, w], 1)[0], launch.run([x, w])[0])


def _parts(**change):
    """Launcher's arguments for one exp over a [2, 3] domain, with ``change`` applied."""
    kernel = vm.Kernel(
        Program((Instr(Op.LOAD, 0, 0), Instr(Op.EXP, 1, 0), Instr(Op.STORE, -1, 0, 1)), 1, 1, 2),
        [torch.float32],
    )
    parts = {
        "address": kernel._run_at,
        "code": kernel._code,
        "imm": kernel._imm,
        "n_regs": 2,
        "n_in": 1,
        "out_dtypes": (torch.float32,),
        "reduced": (False,),
        "max_row": None,
        "domain": (2, 3),
        "args": [torch.empty(2, 3)],
        "operands": [(0, (2, 3))],
        "out_shapes": [(2, 3)],
        "out_strides": None,
    }
    return list({**parts, **change}.values())


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"address": 0}, "null"),
        ({"address": -1}, "not the address of a loaded build's dvm_run"),
        ({"address": id(print)}, "not the address of a loaded build's dvm_run"),
        ({"code": [0, 0, 0, 0]}, "five int32"),
        ({"code": [0] * 5 * 257}, "at most"),
        ({"code": [2**40] * 5}, "not an int32"),
        ({"code": [2**40, "x", 0, 0, 0]}, "integer"),  # every entry read before any range
        ({"code": 5}, "code: give a sequence, got int"),
        ({"imm": 0.0}, "imm: give a sequence, got float"),
        ({"imm": ["x", 0.0, 0.0]}, "real number"),
        ({"imm": [0.0]}, "one float per instruction"),
        ({"n_in": 17}, "n_in 17"),
        ({"out_dtypes": (torch.float32,) * 9}, "9 out_dtypes"),
        ({"reduced": (False, True)}, "one flag per output"),
        ({"domain": (1,) * 7}, "need 1 to 6"),
        ({"domain": (1,) * 65}, "need 1 to 6"),
        ({"domain": (2, -3)}, "non-negative"),
        ({"domain": "ab"}, "sequence of ints"),
        ({"domain": (2, 3.0)}, "sequence of ints"),
        ({"args": [torch.empty(2, 3)] * 17}, "at most 16"),
        ({"args": [2.0]}, "arg 0 is a float, not a tensor"),
        ({"args": [torch.empty((1,) * 65)]}, "at most 64 dims"),
        ({"args": [torch.empty(2, 3, dtype=torch.float64)]}, "dtype torch.float64; the VM takes"),
        ({"operands": []}, "takes 1 inputs and 1 outputs, got 0 operands"),
        ({"out_shapes": []}, "got 1 operands and 0 output shapes"),
        ({"operands": [(1, (2, 3))]}, "reads arg 1"),
        ({"operands": [[0]]}, r"each an \(arg, view\) pair"),
        ({"operands": [(0, 5)]}, r"the view in operands\[0\]: give a sequence of ints, got 5"),
        ({"operands": [(0, (2.0, 3))]}, "give a sequence of ints"),
        ({"out_shapes": [(1,) * 65]}, r"out_shapes\[0\]: 65 sizes, at most 64"),
        ({"operands": [(0, (3, 2))]}, r"view \(3, 2\) of \(2, 3\) moves elements"),
        (
            {"args": [torch.empty(1, 2, 3)], "operands": [(0, (1, 2, 3))]},
            r"input 0 has 3 dims, more than the domain \(2, 3\)",
        ),
        ({"args": [torch.empty(2, 1)], "operands": [(0, (2, 1))], "domain": (2, 3)}, None),
        ({"args": [torch.empty(2)], "operands": [(0, (2,))]}, "does not broadcast"),
        ({"out_shapes": [(3, 2)]}, r"output 0: shape \(3, 2\) is not \(2, 3\)"),
        ({"out_strides": [None, None]}, r"one entry per output \(1\)"),
        ({"out_strides": [(1,)]}, r"out_strides\[0\] = \(1,\): give 2 strides"),
        ({"out_strides": [(1, 1)]}, "not a dense, non-overlapping layout of"),
    ],
)
def test_bad_construction_raises(change, match):
    args = _parts(**change)
    held = [a for a in args if isinstance(a, list)] + args[9]  # containers, the tensors bound

    def refs():
        return [sys.getrefcount(a) for a in held]

    before = refs()
    for _ in range(3):
        if match is None:  # binds: a broadcast operand over the domain
            launcher = _launcher.Launcher(*args)
            x = torch.randn(2, 1)
            torch.testing.assert_close(launcher.run([x])[0], x.exp().expand(2, 3))
            del launcher
            continue
        with pytest.raises((ValueError, TypeError), match=match):
            _launcher.Launcher(*args)
    assert refs() == before  # nothing kept by a binding, failed or dropped
    launcher = _launcher.Launcher(*_parts())
    x = torch.randn(2, 3)
    torch.testing.assert_close(launcher.run([x])[0], x.exp())


def test_an_output_dtype_the_vm_does_not_store_is_a_type_error():
    """The launcher reads each output's VM code from its dtype (callers gave the codes too)."""
    with pytest.raises(TypeError, match=r"^output 0 has dtype torch\.float64; the VM takes"):
        _launcher.Launcher(*_parts(out_dtypes=(torch.float64,)))


def test_a_launcher_is_initialised_once_and_not_used_before():
    launcher = _launcher.Launcher.__new__(_launcher.Launcher)
    with pytest.raises(TypeError, match="not initialised"):
        launcher.run([torch.randn(2, 3)])
    for call in (launcher.guarded, launcher.mismatch):
        with pytest.raises(TypeError, match="not initialised"):
            call([torch.randn(2, 3)], ())
    with pytest.raises(ValueError, match="moves elements"):
        launcher.__init__(*_parts(operands=[(0, (3, 2))]))
    with pytest.raises(TypeError, match="not initialised"):  # a failed binding leaves none
        launcher.run([torch.randn(2, 3)])
    launcher.__init__(*_parts())
    assert launcher.shapes == (torch.Size((2, 3)),)
    assert launcher.dtypes == (torch.float32,)
    with pytest.raises(TypeError, match="initialised once"):
        launcher.__init__(*_parts(operands=[(0, (5, 5))]))
    x = torch.randn(2, 3)
    torch.testing.assert_close(launcher.run([x])[0], x.exp())


class _Size:
    """A size whose ``__index__`` runs ``hook`` first: user code that binding runs."""

    def __init__(self, value, hook):
        self.value, self.hook = value, hook

    def __index__(self):
        self.hook()
        return self.value


def test_code_run_while_binding_cannot_reach_the_half_bound_launcher():
    launcher = _launcher.Launcher.__new__(_launcher.Launcher)
    seen = []

    def meddle():
        for attempt in (
            lambda: launcher.run([torch.randn(2, 3)]),
            lambda: launcher.__init__(*_parts()),
        ):
            try:
                attempt()
            except TypeError as e:
                seen.append(str(e))

    launcher.__init__(*_parts(operands=[(0, (_Size(2, meddle), 3))]))
    assert seen == ["this Launcher was not initialised", "a Launcher is initialised once"]
    x = torch.randn(2, 3)
    torch.testing.assert_close(launcher.run([x])[0], x.exp())


@pytest.mark.parametrize("which", ["operands", "out_shapes", "out_strides"])
def test_lists_emptied_while_binding_are_bound_as_given(which):
    """Binding reads its own copies: an __index__ that empties the caller's lists (it crashed
    the first version of the C binding) changes nothing."""
    lists: list[list] = []

    def empty():
        for item in lists:
            item.clear()

    sizes = [_Size(2, empty), 3]
    given = {
        "operands": [(0, sizes)],
        "out_shapes": [sizes],
        "out_strides": [[_Size(3, empty), 1]],
    }[which]
    lists += [given, given[0] if which != "operands" else sizes, sizes]
    launcher = _launcher.Launcher(*_parts(**{which: given}))
    assert given == []
    x = torch.randn(2, 3)
    torch.testing.assert_close(launcher.run([x])[0], x.exp())


class _Backwards(tuple):
    """A tuple iterated backwards: binding reads what iterating a sequence gives."""

    def __iter__(self):
        return iter(tuple.__getitem__(self, slice(None, None, -1)))


@pytest.mark.parametrize("which", ["operands", "out_shapes"])
def test_sizes_are_read_as_iterating_them_gives(which):
    given = {"operands": [(0, _Backwards((3, 2)))], "out_shapes": [_Backwards((3, 2))]}[which]
    launcher = _launcher.Launcher(*_parts(**{which: given}))
    x = torch.randn(2, 3)
    torch.testing.assert_close(launcher.run([x])[0], x.exp())
    sizes = {"domain": SIZE, "args": [torch.empty(SIZE)], "operands": [(0, SIZE)]}
    launcher = _launcher.Launcher(*_parts(**sizes, out_shapes=[SIZE]))  # torch.Size, read as is
    x = torch.randn(SIZE)
    torch.testing.assert_close(launcher.run([x])[0], x.exp())


def test_sizes_whose_products_pass_int64_are_refused():
    class Huge:  # binding reads only an arg's shape and dtype
        shape = torch.Size((2**32,) * 3)
        dtype = torch.float32

    big = {"domain": (2**32,) * 3, "args": [Huge()], "operands": [(0, (2**32,) * 3)]}
    strides = [(2**63 - 1, 2**32, 1)]  # dense only in wrapping int64 arithmetic
    with pytest.raises(ValueError, match="not a dense, non-overlapping layout"):
        _launcher.Launcher(*_parts(**big, out_shapes=[(2**32,) * 3], out_strides=strides))
    with pytest.raises(ValueError, match=r"output 0: more than 2\*\*63 elements"):
        _launcher.Launcher(*_parts(**big, out_shapes=[(2**32,) * 3]))


@pytest.mark.parametrize("mode", [False, True], ids=["plain", "under-a-torch-function-mode"])
def test_a_refusal_made_at_binding_is_raised_by_each_call(mode):
    """Also where a TorchFunctionMode is on: the error raised while torch function handling is
    off comes out as it was raised."""
    import contextlib

    from torch.overrides import TorchFunctionMode

    class Passing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    launcher = _launcher.Launcher(*_parts(max_row=2))
    with Passing() if mode else contextlib.nullcontext():
        for _ in range(2):
            with pytest.raises(
                vm.VMError, match="rows of 3 elements: the VM reduces rows of at most 2"
            ):
                launcher.run([torch.randn(2, 3)])


def test_a_status_from_the_vm_is_a_vm_error():
    launcher = _launcher.Launcher(*_parts(n_regs=0))  # the VM refuses the program
    with pytest.raises(vm.VMError, match="dvm_run refused the call: the encoded program"):
        launcher.run([torch.randn(2, 3)])


def _add(n: int) -> vm.Launch:
    p = Program(
        (
            Instr(Op.LOAD, 0, 0),
            Instr(Op.LOAD, 1, 1),
            Instr(Op.ADD, 2, 0, 1),
            Instr(Op.STORE, -1, 0, 2),
        ),
        2,
        1,
        3,
    )
    ones = torch.ones(n)
    return vm.Kernel(p, [torch.float32]).bind((n,), [ones, ones], [(0, (n,)), (1, (n,))], [(n,)])


def test_a_call_holds_its_args_while_code_it_runs_drops_the_callers():
    """Code a call runs (here a torch dispatch mode's, at the outputs' allocation, after the
    args' data pointers are read) may drop the caller's references: the call holds its own."""
    from torch.utils._python_dispatch import TorchDispatchMode

    n = 1 << 16
    args: list = []

    class Dropping(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, fargs=(), kwargs=None):
            out = func(*fargs, **(kwargs or {}))
            if func is torch.ops.aten.empty_strided.default and args:
                args.clear()
                torch.full((n,), 7.0)  # would reuse a freed input's memory
            return out

    launch = _add(n)
    for _ in range(2):
        args[:] = [torch.ones(n), torch.ones(n)]
        with Dropping():
            (out,) = launch.run(args)
        assert not args  # the mode ran and dropped them
        assert torch.equal(out, torch.full((n,), 2.0))


def test_a_torch_function_mode_does_not_see_what_a_call_reads():
    """A TorchFunctionMode sees every tensor method call, also a plain tensor's: one that
    misstated strides would send the VM out of bounds. A call reads its args with torch
    function handling off."""
    from torch.overrides import TorchFunctionMode

    seen = []

    class Lying(TorchFunctionMode):
        def __torch_function__(self, func, types, fargs=(), kwargs=None):
            seen.append(getattr(func, "__name__", func))
            if getattr(func, "__name__", "") == "stride":
                return (2**40,)
            return func(*fargs, **(kwargs or {}))

    launch = _add(4)
    x = torch.ones(4)
    with Lying():
        (out,) = launch.run([x, x])
        got = launch.guarded([x, x], ((0, None),))
        assert launch.mismatch([x, x], False) is None
    assert seen == []
    assert torch.equal(out, x + x)
    assert torch.equal(got[0], x + x)


def test_a_launch_refused_at_binding_keeps_no_inputs_alive():
    p = Program(
        (Instr(Op.LOAD, 0, 0), Instr(Op.REDUCE_SUM, 1, 0), Instr(Op.STORE, -1, 0, 1)), 1, 1, 2
    )
    kernel = vm.Kernel(p, [torch.float32], [True])
    row = vm._lib.max_row(kernel.isa) + 1
    launch = kernel.bind((2, row), [torch.empty(2, row)], [(0, (2, row))], [(2, 1)])
    alive = []
    for k in range(6):
        x = torch.zeros(2, row)
        alive.append(weakref.ref(x))
        call, args = (kernel, ([x], (2, row))) if k < 3 else (launch.guarded, ((x,), ((0, None),)))
        with pytest.raises(vm.VMError, match="rows of") as info:
            call(*args)
        del x, args, call, info
    gc.collect()
    assert [r() for r in alive] == [None] * len(alive)
    bound = weakref.ref(launch)
    del launch
    gc.collect()
    assert bound() is None


def test_run_names_the_mismatch_and_takes_any_thread_count():
    launch = _add(4)
    x = torch.ones(4)
    with pytest.raises(TypeError, match="arg 1 does not match the launch: not a tensor"):
        launch.run([x, 1.0])
    with pytest.raises(ValueError, match="arg 0 does not match the launch: dtype"):
        launch.run([x.double(), x])
    with pytest.raises(TypeError, match="arg 0 does not match the launch: a tensor subclass"):
        launch.run([x.as_subclass(_LyingStride), x])
    with pytest.raises(TypeError, match=r"arg 1 is a _LyingStride, a torch\.Tensor subclass"):
        launch([x, x.as_subclass(_LyingStride)])
    assert torch.equal(launch(iter([x, x]))[0], x + x)  # an iterator is read once
    for threads in (2**63, 2**80, -(2**70)):
        assert torch.equal(launch.run([x, x], threads)[0], x + x)


def test_a_compiled_graph_runs_a_tensor_subclass_eagerly():
    """A subclass's own methods could misstate its strides or memory, which the VM reads
    directly (a stride of 2**40 here): its region runs eagerly, with the right result."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from dvm.compile import compile_graph

    def fn(x):
        return (x * torch.sigmoid(x)).exp()

    x = torch.randn(64, 64)
    compiled = compile_graph(make_fx(fn)(x), [x])
    assert compiled.regions
    lying = x.as_subclass(_LyingStride)
    got = compiled(lying)
    assert compiled.vm_calls == 0
    assert compiled.eager_calls >= 1
    torch.testing.assert_close(got.as_subclass(torch.Tensor), fn(x))
    torch.testing.assert_close(compiled(x), fn(x))
    assert compiled.vm_calls == 1
