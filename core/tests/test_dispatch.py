from __future__ import annotations

import itertools
import json
import sys

import pytest
import torch

from spore import dispatch
from spore.registry import DuplicateRegistrationError

_names = itertools.count()


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _define(**kwargs):
    name = f"t_rms_{next(_names)}"
    return dispatch.define(
        name, "(Tensor x, Tensor w, float eps) -> Tensor", reference=_rms, **kwargs
    )


def _inputs(dtype=torch.float32, requires_grad=False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=g, dtype=dtype).requires_grad_(requires_grad)
    w = torch.randn(8, generator=g, dtype=dtype).requires_grad_(requires_grad)
    return x, w


def test_reference_runs_without_kernels_and_gradcheck_passes() -> None:
    op = _define()
    x, w = _inputs(torch.float64, requires_grad=True)
    torch.testing.assert_close(op(x, w, 1e-6), _rms(x, w, 1e-6))
    assert getattr(torch.ops.spore, op.name) is op.packet
    assert torch.autograd.gradcheck(lambda a, b: op(a, b, 1e-6), (x, w))
    assert op(x, w, 1e-6).grad_fn.name() == f"Spore_{op.name}Backward"  # was FunctionBackward


def test_reference_autograd_gives_second_order_gradients() -> None:
    """create_graph=True through the default formula: the gradient is differentiable again
    (a gradient penalty), checked by gradgradcheck and against the reference's own autograd."""
    op = _define()
    x, w = _inputs(torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda a, b: op(a, b, 1e-6), (x, w))
    (gx,) = torch.autograd.grad(op(x, w, 1e-6).pow(2).sum(), x, create_graph=True)
    (want,) = torch.autograd.grad(_rms(x, w, 1e-6).pow(2).sum(), x, create_graph=True)
    assert gx.requires_grad
    torch.testing.assert_close(
        torch.autograd.grad(gx.pow(2).sum(), w)[0], torch.autograd.grad(want.pow(2).sum(), w)[0]
    )


def test_reference_autograd_skips_integer_outputs_and_takes_complex_inputs() -> None:
    def max_dim(x):
        return x.max(dim=-1)  # (values, indices): the indices are int64

    values_op = dispatch.define(
        f"t_max_{next(_names)}", "(Tensor x) -> (Tensor, Tensor)", reference=max_dim
    )
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    values, indices = values_op(x)
    values.sum().backward()
    want = torch.zeros_like(x).scatter_(-1, indices[:, None], 1.0)
    torch.testing.assert_close(x.grad, want)

    def abs2(z):
        return (z * z.conj()).real

    abs_op = dispatch.define(f"t_abs2_{next(_names)}", "(Tensor z) -> Tensor", reference=abs2)
    z = torch.randn(4, dtype=torch.complex128, requires_grad=True)
    abs_op(z).sum().backward()
    z2 = z.detach().clone().requires_grad_()
    abs2(z2).sum().backward()
    torch.testing.assert_close(z.grad, z2.grad)


def test_torch_func_transforms_and_forward_ad_differentiate_the_reference() -> None:
    """Under torch.func (grad, jacrev, jvp, vmap) and forward-mode AD the op runs its
    reference, whose own ops carry the transform: each result equals the same transform of the
    reference. (A torch.library op with register_autograd raises under torch.func.grad and
    gives zero tangents under jvp and forward AD; with no batching rule, vmap ran the kernel
    once a sample, warning each time.)"""
    op = _define()
    calls = []

    def kernel(x, w, eps):  # right values, but opaque to every transform
        calls.append(x.shape)
        return _rms(x.detach(), w.detach(), eps)

    dispatch.register_kernel(op, "cpu", kernel, provider="t-transforms")
    x, w = _inputs(torch.float64)
    t = torch.randn_like(x)
    torch.testing.assert_close(op(x, w, 1e-6), _rms(x, w, 1e-6))
    assert calls == [x.shape]  # a plain call runs the kernel

    def f(a, b):
        return op(a, b, 1e-6)

    def g(a, b):
        return _rms(a, b, 1e-6)

    def loss(fn):
        return lambda a, b: fn(a, b).sin().sum()

    torch.testing.assert_close(
        torch.func.grad(loss(f), argnums=(0, 1))(x, w),
        torch.func.grad(loss(g), argnums=(0, 1))(x, w),
    )
    torch.testing.assert_close(torch.func.jacrev(f)(x, w), torch.func.jacrev(g)(x, w))
    torch.testing.assert_close(
        torch.func.jvp(lambda a: f(a, w), (x,), (t,)),
        torch.func.jvp(lambda a: g(a, w), (x,), (t,)),
    )
    assert calls == [x.shape]
    torch.testing.assert_close(
        torch.func.vmap(lambda r: f(r, w))(x.view(2, 2, 8)), g(x, w).view(2, 2, 8)
    )
    ws = torch.randn(2, 8, dtype=torch.float64)  # a weight batched too
    torch.testing.assert_close(
        torch.func.vmap(f)(x.view(2, 2, 8), ws), g(x.view(2, 2, 8), ws[:, None])
    )
    torch.testing.assert_close(
        torch.func.vmap(torch.func.grad(loss(f)), in_dims=(0, None))(x.view(2, 2, 8), w),
        torch.func.vmap(torch.func.grad(loss(g)), in_dims=(0, None))(x.view(2, 2, 8), w),
    )
    assert calls == [x.shape]  # vmap never ran the kernel once a sample
    with torch.autograd.forward_ad.dual_level():
        out = f(torch.autograd.forward_ad.make_dual(x, t), w)
        want = g(torch.autograd.forward_ad.make_dual(x, t), w)
        got = torch.autograd.forward_ad.unpack_dual(out)
        expected = torch.autograd.forward_ad.unpack_dual(want)
    assert got.tangent is not None
    torch.testing.assert_close(got.tangent, expected.tangent)
    torch.testing.assert_close(got.primal, expected.primal)
    assert len(calls) == 1


def test_custom_autograd_formula_is_used() -> None:
    seen = []

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    def backward(ctx, grad):
        seen.append(ctx.needs_input_grad)
        return grad * 0 + 7, None, None

    op = _define(backward=backward, setup_context=setup_context)
    x, w = _inputs(requires_grad=True)
    op(x, w.detach(), 1e-6).sum().backward()
    assert seen == [(True, False, False)]  # one flag per input of the op
    assert torch.equal(x.grad, torch.full_like(x, 7.0))


def test_kernels_added_or_removed_after_calls_take_effect() -> None:
    op = _define()
    x, w = _inputs()
    ran = []

    def kernel(tag):
        def fn(x, w, eps):
            ran.append(tag)
            return _rms(x, w, eps)

        return fn

    dispatch.register_kernel(op, "cpu", kernel("low"), provider="low_provider", priority=1)
    op(x, w, 1e-6)
    dispatch.register_kernel(op, "cpu", kernel("high"), provider="high_provider", priority=5)
    op(x, w, 1e-6)
    dispatch.unregister_provider("high_provider")
    op(x, w, 1e-6)
    dispatch.unregister_provider("low_provider")
    torch.testing.assert_close(op(x, w, 1e-6), _rms(x, w, 1e-6))
    assert ran == ["low", "high", "low"]
    assert [k.provider for k in op.candidates("cpu")] == []


def test_a_ranking_racing_a_registration_is_not_kept() -> None:
    """A call ranks the kernels while another thread registers one: the registration lands
    between the call's read of the kernels and its store of the ranking (forced here: reading
    the old kernels triggers it). The next call must see the new kernel."""
    op = _define()
    x, w = _inputs()
    first = dispatch.register_kernel(op, "cpu", lambda x, w, eps: _rms(x, w, eps), provider="a")
    old = dict(op.kernels)

    class Racing(dict):
        def items(self):
            dispatch.register_kernel(
                op, "cpu", lambda x, w, eps: _rms(x, w, eps), provider="b", priority=5
            )
            return super().items()

    op._set_kernels(Racing(old))
    assert op.candidates("cpu") == [first]  # ranked what it read
    assert [k.provider for k in op.candidates("cpu")] == ["b", "a"]
    assert op.select((x, w, 1e-6), {})[0].provider == "b"


def test_best_supported_kernel_runs_and_explain_says_why() -> None:
    op = _define()
    calls = []

    def kernel(tag):
        def run(x, w, eps):
            calls.append(tag)
            return _rms(x, w, eps)

        return run

    dispatch.register_kernel(op, "cpu", kernel("low"), provider="low", priority=1)
    dispatch.register_kernel(
        op,
        "cpu",
        kernel("high"),
        provider="high",
        priority=9,
        supports=lambda x, w, eps: x.dtype == torch.float32,
    )
    dispatch.register_kernel(
        op,
        "cpu",
        kernel("broken"),
        provider="broken",
        priority=20,
        supports=lambda x, w, eps: 1 / 0,
    )
    x, w = _inputs()
    op(x, w, 1e-6)
    op(x.double(), w.double(), 1e-6)
    assert calls == ["high", "low"]
    report = dispatch.explain(op, x, w, 1e-6)
    assert report.chosen == "high"
    assert [(c.provider, c.chosen) for c in report.candidates] == [
        ("broken", False),
        ("high", True),
        ("low", False),
    ]
    assert report.candidates[0].reason == "supports() raised ZeroDivisionError: division by zero"
    assert "higher priority" in report.candidates[2].reason
    assert "runs high" in str(report)
    assert dispatch.explain(op, x.double(), w.double(), 1e-6).chosen == "low"


def test_an_op_that_casts_under_autocast_runs_and_explains_the_cast_arguments() -> None:
    """explain judges the arguments the kernels get: under autocast, those the op's
    ``autocast`` function returns, not the caller's."""

    def to_autocast_dtype(x, w, eps):
        dtype = torch.get_autocast_dtype("cpu")
        return x.to(dtype), w.to(dtype), eps

    op = _define(autocast=to_autocast_dtype)
    ran = []

    def bf16_kernel(x, w, eps):
        ran.append((x.dtype, w.dtype))
        return _rms(x, w, eps)

    dispatch.register_kernel(
        op,
        "cpu",
        bf16_kernel,
        provider="bf16_provider",
        supports=lambda x, w, eps: x.dtype == w.dtype == torch.bfloat16,
    )
    x, w = _inputs()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert dispatch.explain(op, x, w, 1e-6).chosen == "bf16_provider"
            assert op(x, w, 1e-6).dtype == torch.bfloat16
            assert ran == [(torch.bfloat16, torch.bfloat16)]
            compiled = torch.compile(
                lambda a, b: op(a, b, 1e-6), backend="aot_eager", fullgraph=True
            )
            assert compiled(x, w).dtype == torch.bfloat16
        assert dispatch.explain(op, x, w, 1e-6).chosen == "reference"
        assert op(x, w, 1e-6).dtype == torch.float32
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
            assert dispatch.explain(op, x, w, 1e-6).chosen == "reference"
        plain = _define()  # no autocast function: arguments as they are
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert plain(x, w, 1e-6).dtype == torch.float32
    finally:
        dispatch.unregister_provider("bf16_provider")
    with pytest.raises(TypeError, match="autocast must be callable or None"):
        _define(autocast="bf16")
    schema = "(Tensor x, Tensor w, float eps) -> Tensor"
    again = dispatch.define(op.name, schema, reference=_rms, autocast=to_autocast_dtype)
    assert again is op  # the same function: a plugin loaded twice
    for other in (None, _rms):  # it was silently ignored
        with pytest.raises(DuplicateRegistrationError, match="already defined with autocast="):
            dispatch.define(op.name, schema, reference=_rms, autocast=other)


def test_batched_gradients_of_an_op_with_an_optional_result() -> None:
    """autograd.grad(is_grads_batched=True) and gradcheck's batched check run the older vmap,
    whose per-sample fallback refuses an op returning an optional tensor: such an op raised."""
    op = dispatch.define(
        f"t_opt_{next(_names)}",
        "(Tensor x, Tensor? w) -> (Tensor, Tensor?)",
        reference=lambda x, w: (x * 2.0, None if w is None else w * x),
    )
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, dtype=torch.float64)
    grads = torch.randn(5, 3, 4, dtype=torch.float64)
    out, scaled = op(x, w)
    got = torch.autograd.grad((out, scaled), x, (grads, grads), is_grads_batched=True)[0]
    torch.testing.assert_close(got, grads * 2.0 + grads * w)
    assert torch.autograd.gradcheck(lambda t: op(t, w)[1], (x,), check_batched_grad=True)
    older_vmap = torch._vmap_internals._vmap  # what both run the backward's ops under
    torch.testing.assert_close(older_vmap(lambda a, b: op(a, b)[1])(grads, grads), grads * grads)


def test_explain_says_how_a_tie_was_broken() -> None:
    """The loser of a tie was told the winner had "a higher priority" (both had 5)."""
    op = _define()
    for provider in ("beta", "alpha"):
        dispatch.register_kernel(op, "cpu", _rms, priority=5, provider=provider)
    why = dispatch.explain(op, *_inputs(), 1e-6)
    (beta,) = [c for c in why.candidates if c.provider == "beta"]
    assert beta.reason == (
        "alpha sorts first at the same priority (provider names break ties) and accepts the "
        "arguments"
    )


def test_explain_takes_keyword_arguments_as_a_call_does() -> None:
    """A call's keyword arguments reach kernels by position; explain passed them by keyword
    after filling their positions with defaults, so supports() raised and it named the
    reference where the call ran the kernel."""
    op = dispatch.define(
        f"t_kw_{next(_names)}",
        "(Tensor x, Tensor w, float eps=1e-06) -> Tensor",
        reference=_rms,
    )
    calls = []

    def fast(x, w, eps):
        calls.append(eps)
        return _rms(x, w, eps)

    dispatch.register_kernel(op, "cpu", fast, provider="fast", supports=lambda x, w, eps: eps < 0.1)
    x, w = _inputs()
    for kwargs in ({"eps": 0.01}, {"w": w, "eps": 0.01}, {"w": w}):
        given = (x,) if "w" in kwargs else (x, w)
        op(*given, **kwargs)
        assert dispatch.explain(op, *given, **kwargs).chosen == "fast"
    assert calls == [0.01, 0.01, 1e-06]
    assert dispatch.explain(op, x, w, eps=0.5).chosen == "reference"
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'epsilon'"):
        dispatch.explain(op, x, w, epsilon=0.5)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda op, x, w: dispatch.explain(op, x), "missing a required argument: 'w'"),
        (lambda op, x, w: dispatch.explain(op, x, w, 0.1, 2), "too many positional arguments"),
        (lambda op, x, w: dispatch.explain(op, "x", w), "'x' must be a Tensor, got str"),
        (lambda op, x, w: dispatch.explain(op, x, None), "'w' must be a Tensor, got NoneType"),
    ],
    ids=["missing", "extra", "not-a-tensor", "none"],
)
def test_explain_refuses_a_call_the_op_refuses(call, message) -> None:
    """explain filled a missing argument with None and asked supports() about calls the op
    itself refuses; it now raises the call's TypeError, with the schema, before any kernel."""
    op = dispatch.define(
        f"t_bad_{next(_names)}", "(Tensor x, Tensor w, float eps=1e-06) -> Tensor", reference=_rms
    )
    asked = []
    dispatch.register_kernel(op, "cpu", _rms, provider="fast", supports=lambda *a: asked.append(a))
    x, w = _inputs()
    with pytest.raises(TypeError, match=message):
        call(op, x, w)
    assert asked == []


@pytest.mark.parametrize(
    "call",
    [
        lambda f, x: f(x, None),
        lambda f, x: f(x.requires_grad_(), None),
        lambda f, x: f(x.to("meta"), None),
        lambda f, x: torch.vmap(lambda row: f(row, None))(x),
    ],
    ids=["eager", "grad", "meta", "vmap"],
)
def test_a_call_with_none_for_a_tensor_is_refused_as_explain_refuses_it(call) -> None:
    """The dispatcher passes None on for a Tensor argument: the kernel got it and failed inside
    (AttributeError: 'NoneType' object has no attribute 'dtype'); the op now raises explain's
    TypeError, naming the argument and the schema, before any kernel or reference runs."""
    op = dispatch.define(
        f"t_none_{next(_names)}", "(Tensor x, Tensor w, float eps=1e-06) -> Tensor", reference=_rms
    )
    ran = []
    dispatch.register_kernel(op, "cpu", lambda *a: ran.append(a), provider="fast")
    message = r"'w' must be a Tensor, got NoneType \(schema: t_none_\d+\(Tensor x, Tensor w"
    with pytest.raises(TypeError, match=message):
        call(op.packet, torch.randn(4, 8))
    assert ran == []


def test_no_kernel_for_the_device_falls_back_to_the_reference() -> None:
    op = _define()
    dispatch.register_kernel(op, "cuda", lambda *a: 1 / 0, provider="gpu")
    x, w = _inputs()
    torch.testing.assert_close(op(x, w, 1e-6), _rms(x, w, 1e-6))
    report = dispatch.explain(op.name, x, w, 1e-6)
    assert report.chosen == "reference"
    assert report.candidates[0].reason == "no kernel for cpu (kernels for: cuda)"


def test_duplicates_redefinition_and_bad_input() -> None:
    op = _define()
    fn = lambda x, w, eps: _rms(x, w, eps)  # noqa: E731
    dispatch.register_kernel(op, "cpu", fn, provider="p")
    dispatch.register_kernel(op, "cpu", fn, provider="p")  # the same function: a reload
    with pytest.raises(DuplicateRegistrationError, match="'p' already registered a cpu kernel"):
        dispatch.register_kernel(op, "cpu", lambda *a: None, provider="p")
    dispatch.register_kernel(op, "cpu", _rms, provider="p", override=True)
    assert op.kernels[("cpu", "p")].fn is _rms
    assert dispatch.define(op.name, op.schema, reference=_rms) is op
    with pytest.raises(DuplicateRegistrationError, match="cannot redefine"):
        dispatch.define(op.name, "(Tensor x) -> Tensor", reference=_rms)
    with pytest.raises(ValueError, match="Python identifier"):
        dispatch.define("bad-name", "(Tensor x) -> Tensor", reference=_rms)
    with pytest.raises(ValueError, match="both backward and setup_context"):
        dispatch.define("half", "(Tensor x) -> Tensor", reference=_rms, backward=_rms)
    with pytest.raises(ValueError, match="lower-case device type"):
        dispatch.register_kernel(op, "CPU", _rms, provider="q")
    for device in ("cuda:0", " cpu"):  # taken, and never matched
        with pytest.raises(ValueError, match="not a device such as 'cuda:0'"):
            dispatch.register_kernel(op, device, _rms, provider="q")
    # a str priority was taken, then every call of the op raised in the kernels' sort
    for priority in ("10", None, 1.5, True):
        with pytest.raises(TypeError, match="a kernel's priority must be an int"):
            dispatch.register_kernel(op, "cpu", _rms, provider="q", priority=priority)
    with pytest.raises(TypeError, match="a kernel must be callable"):
        dispatch.register_kernel(op, "cpu", None, provider="q")
    with pytest.raises(TypeError, match="supports must be callable"):
        dispatch.register_kernel(op, "cpu", _rms, provider="q", supports=True)
    assert set(op.kernels) == {("cpu", "p")}  # nothing refused was registered
    with pytest.raises(KeyError, match="no spore op named 'nope'") as info:
        dispatch.get("nope")
    assert "spore.plugins.get_manager().load() loads every plugin" in str(info.value)


def test_compiles_fullgraph_and_picks_the_kernel_at_run_time() -> None:
    op = _define()
    calls = []

    def fast(x, w, eps):
        calls.append(1)
        return _rms(x, w, eps)

    dispatch.register_kernel(op, "cpu", fast, provider="fast")
    compiled = torch.compile(lambda x, w: op(x, w, 1e-6) * 2, fullgraph=True)
    x, w = _inputs(requires_grad=True)
    out = compiled(x, w)
    out.sum().backward()
    xr, wr = (t.detach().requires_grad_() for t in (x, w))
    expected = _rms(xr, wr, 1e-6) * 2
    expected.sum().backward()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(w.grad, wr.grad)
    assert calls, "the compiled graph must call the op, which picks the kernel"


def test_plugin_ops_are_registered_owned_and_withdrawn(fixture_plugins, spore_manager) -> None:
    fixture_plugins("ops")
    manager = spore_manager()
    registry = manager.registry("ops")
    assert registry.entry("fixture_scale").owner == "ops"
    assert registry.entry("fixture_scale").owner_version == "1.0.0"  # the distribution's
    assert "fixture_scale[cpu]@ops" in registry
    module = sys.modules["spore_fixture_ops"]
    x = torch.ones(3)
    torch.ops.spore.fixture_scale(x, 2.0)
    torch.ops.spore.fixture_scale(x.double(), 2.0)
    assert [torch.float32] == module.CALLS
    assert dispatch.explain("fixture_scale", x.double(), 2.0).chosen == "reference"
    registry.remove_owner("ops")
    assert dispatch.get("fixture_scale").kernels == {}


def test_define_refuses_a_reference_fake_or_backward_that_is_not_callable() -> None:
    """reference=None was taken: the op was defined for good, every call failed with
    "'NoneType' object is not callable", and defining it again returned the broken op."""
    name = f"t_uncallable_{next(_names)}"
    schema = "(Tensor x) -> Tensor"
    with pytest.raises(TypeError, match=f"op '{name}': reference must be callable"):
        dispatch.define(name, schema, reference=None)
    for what in ("fake", "backward", "setup_context"):
        kwargs = {"backward": _rms, "setup_context": _rms, what: torch}
        with pytest.raises(TypeError, match=f"op '{name}': {what} must be callable or None"):
            dispatch.define(name, schema, reference=torch.neg, **kwargs)
    assert name not in [op.name for op in dispatch.defined()]
    op = dispatch.define(name, schema, reference=torch.neg)
    assert torch.equal(op(torch.ones(2)), -torch.ones(2))


def test_ops_of_another_namespace_are_refused() -> None:
    """register_kernel(torch.ops.aten.add.Tensor, ...) and explain() of it took the spore op of
    the same base name: a kernel meant for aten.add ran for spore::add."""
    name = f"t_ns_{next(_names)}"
    op = dispatch.define(name, "(Tensor x) -> Tensor", reference=torch.neg)
    # an op of that name in another namespace: the base name alone finds the spore op
    lib = torch.library.Library("spore_test_other", "FRAGMENT")
    lib.define(f"{name}(Tensor x) -> Tensor")
    packet = getattr(torch.ops.spore_test_other, name)
    for other in (packet, packet.default):
        with pytest.raises(ValueError, match=f"spore_test_other::{name} is not a spore op"):
            dispatch.register_kernel(other, "cpu", torch.abs, provider="p")
        with pytest.raises(ValueError, match=f"spore_test_other::{name} is not a spore op"):
            dispatch.explain(other, torch.ones(1))
    with pytest.raises(ValueError, match="aten::add is not a spore op"):
        dispatch.register_kernel(torch.ops.aten.add.Tensor, "cpu", torch.abs, provider="p")
    with pytest.raises(TypeError, match=r"expected a spore op \(.*\), got builtin_function"):
        dispatch.register_kernel(torch.neg, "cpu", torch.abs, provider="p")
    assert op.kernels == {}
    for same in (op, name, f"spore::{name}", op.packet, op.packet.default):
        assert dispatch.explain(same, torch.ones(1)).op == name


def test_a_provider_must_be_a_non_empty_str() -> None:
    """A provider of None, '' or 3 was taken; then every call of the op failed sorting the
    kernels, and unregister_provider (a failed plugin's cleanup) raised AttributeError."""
    from spore.registry import OpRegistry

    op = _define()
    for provider in (None, 3):
        with pytest.raises(TypeError, match="a kernel's provider must be a str naming the plugin"):
            dispatch.register_kernel(op, "cpu", _rms, provider=provider)
        with pytest.raises(TypeError, match="Registrar's provider must be a str naming"):
            dispatch.Registrar(provider)
    with pytest.raises(ValueError, match="a kernel's provider must name the plugin or package"):
        dispatch.register_kernel(op, "cpu", _rms, provider="")
    with pytest.raises(ValueError, match="Registrar's provider must name the plugin or package"):
        dispatch.Registrar("")
    registrar, registry = dispatch.Registrar("acme"), OpRegistry("op")
    for provider in ("acme:", "", "other:x"):  # a sub-provider with no name, or another's
        with pytest.raises(ValueError, match="as 'acme' or 'acme':<name>"):
            registrar.kernel(op, "cpu", _rms, provider=provider)
        with registry.owned_by("acme"), pytest.raises(ValueError, match="as 'acme' or"):
            registry.kernel(op, "cpu", _rms, provider=provider)
    for provider in (3, b"acme:x"):  # not a str: a TypeError, as from register_kernel
        with pytest.raises(TypeError, match=r"a provider must be a str, got (int 3|bytes)"):
            registrar.kernel(op, "cpu", _rms, provider=provider)
        with registry.owned_by("acme"), pytest.raises(TypeError, match="a provider must be"):
            registry.kernel(op, "cpu", _rms, provider=provider)
    assert op.kernels == {}
    x, w = _inputs()
    torch.testing.assert_close(op(x, w, 1e-6), _rms(x, w, 1e-6))
    dispatch.unregister_provider("other")


def test_a_registrar_or_plugin_may_name_itself_as_the_provider() -> None:
    """``Registrar("acme").kernel(..., provider="acme")`` was refused with "registers kernels
    as 'acme' or 'acme':<name>, not 'acme'"; it is the same as leaving the provider out."""
    from spore.registry import OpRegistry

    op = _define()
    kernel = dispatch.Registrar("acme").kernel(op, "cpu", _rms, provider="acme")
    assert kernel.provider == "acme"
    registry = OpRegistry("op")
    with registry.owned_by("beta"):
        assert registry.kernel(op, "cpu", _rms, provider="beta").provider == "beta"
    assert sorted(op.kernels) == [("cpu", "acme"), ("cpu", "beta")]
    registry.remove_owner("beta")
    dispatch.unregister_provider("acme")
    assert op.kernels == {}


def test_a_plugin_registers_kernels_under_sub_providers() -> None:
    from spore.registry import OpRegistry

    registry = OpRegistry("op")
    op = _define()
    x, w = _inputs()
    with registry.owned_by("acme"):
        registry.kernel(op, "cpu", lambda *a: _rms(*a) * 0 + 1, provider="acme:fast", priority=5)
        registry.kernel(op, "cpu", lambda *a: _rms(*a) * 0 + 2)
        with pytest.raises(ValueError, match="as 'acme' or 'acme':<name>"):
            registry.kernel(op, "cpu", _rms, provider="other:fast")
    assert sorted(op.kernels) == [("cpu", "acme"), ("cpu", "acme:fast")]
    assert "t_rms" in dispatch.explain(op, x, w, 1e-6).op
    assert dispatch.explain(op, x, w, 1e-6).chosen == "acme:fast"
    assert torch.equal(op(x, w, 1e-6), torch.ones_like(x))
    registry.remove_owner("acme")
    assert op.kernels == {}


def test_plugin_with_ops_keeps_the_contract(fixture_plugins, spore_plugin_contract) -> None:
    fixture_plugins("ops")
    info = spore_plugin_contract("ops")
    assert info.registered["ops"] == ["fixture_scale", "fixture_scale[cpu]@ops"]
    assert info.registered["passes"] == ["fixture-count-nodes"]


@pytest.mark.core_alone
def test_spore_ops_cli(run_spore) -> None:
    out = run_spore("ops", "--json", plugins=("ops",))
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)
    assert row == {
        "op": "spore::fixture_scale",
        "schema": "(Tensor x, float scale) -> Tensor",
        "defined_by": "ops",
        "kernels": {"cpu": [{"provider": "ops", "priority": 5}]},
    }
    table = run_spore("ops", plugins=("ops",))
    assert "cpu: ops (5)" in table.stdout
    assert "No spore ops defined" in run_spore("ops").stdout
    passes = run_spore("passes", "--json", plugins=("ops",))
    assert json.loads(passes.stdout) == [
        {
            "name": "fixture-count-nodes",
            "stage": "post_grad",
            "priority": 3,
            "device": None,
            "version": "2",
            "registered_by": "ops",
        }
    ]
    assert "No graph passes registered" in run_spore("passes").stdout


def test_registrar_defines_and_registers_under_its_provider() -> None:
    registrar = dispatch.Registrar("reg_provider")
    name = f"t_rms_{next(_names)}"
    schema = "(Tensor x, Tensor w, float eps) -> Tensor"
    op = registrar.define(name, schema, reference=_rms)
    assert registrar.define(name, schema, reference=_rms) is op
    x, w = _inputs()
    ran = []

    def kernel(x, w, eps):
        ran.append(True)
        return _rms(x, w, eps)

    registrar.kernel(op, "cpu", kernel, priority=1)
    registrar.kernel(op, "cpu", _rms, provider="reg_provider:other")
    assert sorted(k.provider for k in op.candidates("cpu")) == [
        "reg_provider",
        "reg_provider:other",
    ]
    torch.testing.assert_close(op(x, w, 1e-6), _rms(x, w, 1e-6))
    assert ran == [True]
    with pytest.raises(ValueError, match="'reg_provider' or 'reg_provider':<name>"):
        registrar.kernel(op, "cpu", _rms, provider="someone_else")
    dispatch.unregister_provider("reg_provider")
    assert op.candidates("cpu") == []


def test_calls_below_autograd_reach_the_kernel_under_modes_fakes_and_no_grad() -> None:
    """Without a gradient to record, plain CPU calls go straight to the kernel; fake tensors,
    dispatch modes and grad mode still see the op as before."""
    op = _define()
    ran = []

    def kernel(x, w, eps):
        ran.append(x.shape)
        return _rms(x, w, eps)

    dispatch.register_kernel(op, "cpu", kernel, provider="direct_provider")
    x, w = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(op(x, w, 1e-6), _rms(x, w, 1e-6))
    op(x, w, 1e-6)
    assert len(ran) == 2
    from spore.modes import OpCounter

    with OpCounter() as counter:
        op(x, w, 1e-6)
    assert counter.counts.get(f"spore.{op.name}.default") == 1
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        fake = op(torch.empty(3, 8), torch.empty(8), 1e-6)
    assert isinstance(fake, FakeTensor)
    assert len(ran) == 3  # the fake call ran the fake implementation, not the kernel
    dispatch.unregister_provider("direct_provider")


def test_gradients_see_arguments_the_dispatcher_dropped_as_defaults() -> None:
    """A trailing argument equal to its default reaches setup_context (the dispatcher drops
    it from the call)."""
    seen = []

    def reference(x, scale=2.0):
        return x * scale

    def setup_context(ctx, inputs, output):
        seen.append(inputs[1:])
        ctx.scale = inputs[1]

    def backward(ctx, grad):
        return grad * ctx.scale, None

    op = dispatch.define(
        f"t_scale_{next(_names)}",
        "(Tensor x, float scale=2.0) -> Tensor",
        reference=reference,
        backward=backward,
        setup_context=setup_context,
    )
    x = torch.randn(5, requires_grad=True)
    op(x, 2.0).sum().backward()
    assert seen == [(2.0,)]
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))


def test_kernels_supports_and_the_reference_get_arguments_dropped_as_defaults() -> None:
    """The dispatcher drops trailing arguments equal to their schema default: a reference
    without that default raised TypeError, and a kernel's ``supports(x, scale)`` raised (read
    as "no"), so the kernel never ran for the default value while ``explain`` said it did."""
    calls = []

    def reference(x, scale):  # no Python default: the schema's is the only one
        return x * scale

    def kernel(x, scale):
        calls.append(scale)
        return x * scale

    op = dispatch.define(
        f"t_dflt_{next(_names)}", "(Tensor x, float scale=2.0) -> Tensor", reference=reference
    )
    x = torch.randn(5)
    for call in (lambda: op(x), lambda: op(x, 2.0), lambda: torch.compile(op, fullgraph=True)(x)):
        torch.testing.assert_close(call(), x * 2.0)  # the reference: no kernel yet
    y = x.clone().requires_grad_()
    op(y).sum().backward()
    torch.testing.assert_close(y.grad, torch.full_like(x, 2.0))
    torch.testing.assert_close(torch.vmap(op)(x.view(5, 1)), x.view(5, 1) * 2.0)
    dispatch.register_kernel(
        op, "cpu", kernel, provider="t-dflt", supports=lambda x, scale: scale > 1
    )
    torch.testing.assert_close(op(x, 2.0), x * 2.0)
    torch.testing.assert_close(op(x, 0.5), x * 0.5)
    assert calls == [2.0]
    assert dispatch.explain(op, x).chosen == "t-dflt"


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ("(Tensor x, *, float s) -> Tensor", "keyword-only"),
        ("(Tensor[] xs) -> Tensor", "tensor lists"),
        ("(Tensor x) -> Tensor[]", "tensor lists"),
        ("(Tensor? x, Tensor?[] xs) -> Tensor", "tensor lists"),
        ("(Tensor(a!) x) -> ()", r"writes to an argument \(Tensor\(a!\)\)"),
        ("(Tensor(a!) x, Tensor y) -> Tensor(a!)", "writes to an argument"),
        # defined, then every call leaving w out was refused as None for a Tensor
        ("(Tensor x, Tensor w=None) -> Tensor", r"declare it optional: Tensor\? w=None"),
    ],
)
def test_schemas_the_autograd_kernel_cannot_take_are_refused(schema, message) -> None:
    with pytest.raises(ValueError, match=message):
        dispatch.define(f"t_refused_{next(_names)}", schema, reference=lambda *a, **k: None)


def test_optional_tensors_and_scalar_lists_are_taken() -> None:
    op = dispatch.define(
        f"t_optional_{next(_names)}",
        "(Tensor x, Tensor? w, int[] dims, float? s) -> (Tensor, Tensor)",
        reference=lambda x, w, dims, s: (x * 2, x.sum(dims, keepdim=True)),
    )
    x = torch.randn(3, 4, requires_grad=True)
    y, total = op(x, None, [1], None)
    (y.sum() + total.sum()).backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))
