"""The ``dvm`` torch.compile backend: found by name, trains (forward and backward graphs both
clustered), falls back with reasons, guards recompiles per shape and compiles graphs with
symbolic sizes once a size."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dvm.backend import dvm_backend, make_backend
from dvm.compile import compile_graph


def test_backend_is_found_by_name():
    assert "dvm" in torch._dynamo.list_backends()
    fn = torch.compile(lambda x: F.silu(x) * 2, backend="dvm")
    x = torch.randn(5, 7)
    torch.testing.assert_close(fn(x), F.silu(x) * 2)


def test_dvm_backend_function_compiles():
    x = torch.randn(3, 9)
    fn = torch.compile(lambda t: torch.softmax(t, -1), backend=dvm_backend)
    torch.testing.assert_close(fn(x), torch.softmax(x, -1))


@pytest.mark.parametrize("min_ops", [None, 1])
def test_torch_compile_options_set_min_ops(backend_compiles, min_ops):
    """``options={"min_ops": 1}`` runs a lone op's region on the VM; by default it stays
    PyTorch's kernel."""
    compiled = backend_compiles
    options = None if min_ops is None else {"min_ops": min_ops}
    fn = torch.compile(lambda t: torch.exp(t), backend="dvm", options=options)
    x = torch.randn(4, 6)
    torch.testing.assert_close(fn(x), torch.exp(x))
    (graph,) = compiled
    assert (graph.vm_calls, len(graph.regions)) == ((0, 0) if min_ops is None else (1, 1))


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"min_op": 1}, "min_op: Extra inputs are not permitted"),
        ({"min_ops": 0}, "min_ops: Input should be greater than or equal to 1"),
        ({"min_ops": "2"}, "min_ops: Input should be a valid integer"),
        ({1: 2}, "1: Keys should be strings"),  # was a TypeError from DvmOptions(**options)
        ({"size_limit": 0}, "size_limit: Input should be greater than or equal to 1"),
        ({"size_limit": True}, "size_limit: Input should be a valid integer"),
        ({"size_limit": 2.5}, "size_limit: Input should be a valid integer"),
    ],
)
def test_bad_torch_compile_options_are_named(options, problem):
    torch._dynamo.reset()
    fn = torch.compile(lambda t: torch.exp(t) * 2, backend="dvm", options=options)
    failed = torch._dynamo.exc.BackendCompilerFailed
    with pytest.raises(failed, match=r"dvm: bad torch\.compile options") as info:
        fn(torch.randn(3))
    assert problem in str(info.value)
    assert "dvm takes min_ops (eager kernels a region must stand for" in str(info.value)
    assert "size_limit (different sets of sizes a graph with symbolic sizes compiles" in str(
        info.value
    )


@pytest.mark.parametrize("options", ["min_ops=1", 5, [("min_ops", 1, 2)]])
def test_options_that_are_not_a_dict_are_named(options):
    """A string, a number or a list was dict()'s own error (a TypeError for 5) naming neither
    dvm nor what it takes."""
    import dvm

    torch._dynamo.reset()
    fn = torch.compile(lambda t: torch.exp(t) * 2, backend="dvm", options=options)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        fn(torch.randn(3))
    message = f"dvm: torch.compile options must be a dict, got {type(options).__name__}"
    assert message in str(info.value)
    assert "dvm takes min_ops (eager kernels a region must stand for" in str(info.value)
    with pytest.raises(ValueError, match=message):
        dvm.explain(lambda t: t * 2, torch.randn(3), options=options)


def test_an_inductor_mode_is_ignored_with_a_warning():
    torch._dynamo.reset()
    fn = torch.compile(lambda t: F.silu(t) * 2, backend="dvm", mode="max-autotune")
    x = torch.randn(5, 7)
    with pytest.warns(UserWarning, match="dvm has no compile modes: mode='max-autotune'"):
        got = fn(x)
    torch.testing.assert_close(got, F.silu(x) * 2)


def _record():
    graphs = []
    return graphs, make_backend(lambda kind, c: graphs.append((kind, c)))


def test_training_step_forward_and_backward_on_the_vm():
    graphs, backend = _record()

    def loss_fn(x, w, b):
        h = F.gelu(x * w + b, approximate="tanh")
        return (torch.log_softmax(h, -1) * h).sum()

    x, w, b = (torch.randn(*s, requires_grad=True) for s in [(4, 6, 11), (11,), (11,)])
    want = loss_fn(x, w, b)
    want_grads = torch.autograd.grad(want, [x, w, b])
    got = torch.compile(loss_fn, backend=backend)(x, w, b)
    got_grads = torch.autograd.grad(got, [x, w, b])
    torch.testing.assert_close(got, want)
    for g, e in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
    kinds = [k for k, _ in graphs]
    assert kinds == ["forward", "backward"]
    for _, c in graphs:
        assert c.vm_calls == len(c.regions) >= 1
    # the sum over every dim (the loss) and the bias/weight grads over dims 0, 1 stay eager
    (_, bw) = graphs[1]
    assert any("dim 0" in why for _, why in bw.fallbacks)


def test_backward_frees_saved_activations_as_it_goes():
    """The backward graph is called boxed: each saved activation goes after its last reader,
    as in eager's autograd, not when the whole graph has run."""
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(weakref.ref(t))
        return t

    def f(x, w):
        h = torch.tanh(x @ w)
        return (torch.tanh(h @ w) @ w).sum()

    x, w = torch.randn(8, 8), torch.randn(8, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = torch.compile(f, backend="dvm")(x, w)
    alive = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            alive.append(sum(r() is not None for r in saved))
            return func(*args, **(kwargs or {}))

    with Watch():
        loss.backward()
    assert alive[0] == len(saved) > 2
    assert alive[len(alive) // 2] < alive[0]  # before: all alive until the graph's last op
    torch.testing.assert_close(w.grad, torch.func.grad(f, argnums=1)(x, w.detach()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_stays_whole_and_its_gradients_match(dtype):
    graphs, backend = _record()

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q.sigmoid() * q, k, v, is_causal=True).tanh() * 2

    gen = torch.Generator().manual_seed(0)
    qkv = [torch.randn(1, 2, 8, 16, generator=gen, dtype=dtype) for _ in range(3)]
    want_in = [t.clone().requires_grad_() for t in qkv]
    got_in = [t.clone().requires_grad_() for t in qkv]
    attend(*want_in).sum().backward()
    torch.compile(attend, backend=backend)(*got_in).sum().backward()
    # bf16: the fused chain rounds once where eager rounds after each op
    tol = {"atol": 1e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {}
    for g, e in zip(got_in, want_in, strict=True):
        torch.testing.assert_close(g.grad, e.grad, **tol)
    ops = [str(n.target) for _, c in graphs for n, _ in c.fallbacks]
    assert any("scaled_dot_product" in op for op in ops), ops
    assert all(c.vm_calls >= 1 for _, c in graphs)


def test_inference_graph_under_no_grad():
    graphs, backend = _record()
    x = torch.randn(4, 8)
    with torch.no_grad():
        out = torch.compile(lambda t: torch.tanh(t) * t.mean(-1, keepdim=True), backend=backend)(x)
    torch.testing.assert_close(out, torch.tanh(x) * x.mean(-1, keepdim=True))
    assert [k for k, _ in graphs] == ["inference"]
    assert graphs[0][1].vm_calls == 1


def test_fallbacks_counted_and_explained():
    graphs, backend = _record()

    def fn(x):
        a = x.double().exp()  # float64: eager
        b = x.cumsum(-1)  # no VM lowering: eager
        c = x.sum(0)  # a reduction over dim 0: eager
        return a.float() + b, c.sigmoid() * 2

    x = torch.randn(3, 5)
    got = torch.compile(fn, backend=backend)(x)
    for g, e in zip(got, fn(x), strict=True):
        torch.testing.assert_close(g, e)
    ((_, c),) = graphs
    reasons = [why for _, why in c.fallbacks]
    assert sum("float64" in r for r in reasons) >= 2
    assert sum("no VM lowering" in r for r in reasons) == 1
    assert sum("dim 0" in r for r in reasons) == 1
    assert c.vm_calls == len(c.regions) >= 1


_PAST_RANGE = {  # a scalar the dtype cannot hold: eager raises, or saturates to an infinity
    "where-fp32": (lambda x: torch.where(x > 0, x, -1e300).exp() * 2, torch.float32, True),
    "where-bf16": (lambda x: torch.where(x > 0, x, -1e300).exp() * 2, torch.bfloat16, False),
    "masked_fill-fp16": (lambda x: (x * 2).masked_fill(x > 0, -1e9) + 1, torch.float16, True),
    "clamp-fp16": (lambda x: (x * 2).clamp(-1e6, 1e6) + 1, torch.float16, True),
    "add-fp16": (lambda x: (x * 2 + 1e6) * 3, torch.float16, False),
}


@pytest.mark.parametrize("case", list(_PAST_RANGE))
def test_a_scalar_past_the_dtype_does_what_eager_does(case):
    """Eager raises for some such scalars (fp32 where, masked_fill, clamp) where the VM held an
    infinity and went on; those ops stay eager, with the reason, and raise there."""
    fn, dtype, raises = _PAST_RANGE[case]
    graphs, backend = _record()
    x = torch.randn(4, 8, dtype=dtype)
    compiled = torch.compile(fn, backend=backend)
    if raises:
        with pytest.raises(RuntimeError, match="without overflow"):
            fn(x)
        with pytest.raises(RuntimeError, match="without overflow"):
            compiled(x)
    else:
        torch.testing.assert_close(compiled(x), fn(x), rtol=0, atol=0)
    ((_, c),) = graphs
    assert any("beyond" in why for _, why in c.fallbacks) or any(
        "masked_fill" in str(n.target) for n, _ in c.fallbacks
    )


def test_new_shape_recompiles_and_stays_correct():
    graphs, backend = _record()
    fn = torch.compile(lambda t: torch.sigmoid(t) * t, backend=backend, dynamic=False)
    for shape in [(4, 6), (2, 3, 5)]:
        x = torch.randn(*shape)
        torch.testing.assert_close(fn(x), torch.sigmoid(x) * x)
    assert len(graphs) == 2
    assert all(c.vm_calls == 1 for _, c in graphs)


@pytest.mark.parametrize("dynamic", [False, True])
def test_backward_can_retain_the_graph(dynamic):
    """As in eager; with symbolic sizes AOT autograd compiles the backward with the forward,
    with donated buffers, and refuses a retained graph (as with ``aot_eager``) unless
    ``torch._functorch.config.donated_buffer`` is off (README, Limits)."""

    def fn(x):
        return ((x * 2 + 1).exp() * x).t()

    torch._dynamo.reset()
    x = torch.randn(3, 5, requires_grad=True)
    with torch._functorch.config.patch(donated_buffer=not dynamic):
        out = torch.compile(fn, backend="dvm", dynamic=dynamic)(x)
        out.backward(torch.ones(out.shape), retain_graph=True)
        out.backward(torch.ones(out.shape))
    want = x.detach().clone().requires_grad_()
    ref = fn(want)
    ref.backward(torch.ones(ref.shape), retain_graph=True)
    ref.backward(torch.ones(ref.shape))
    torch.testing.assert_close(x.grad, want.grad)


def test_dynamic_shapes_compile_once_a_size():
    """A graph with symbolic sizes is compiled for each size it runs with (the VM takes
    concrete shapes); ``compile_graph`` itself leaves such a graph eager, with the reason."""
    from torch.fx.experimental.proxy_tensor import make_fx

    graphs, backend = _record()
    fn = torch.compile(lambda t: torch.sigmoid(t) * t, backend=backend, dynamic=True)
    for shape in [(4, 6), (5, 3), (4, 6)]:
        x = torch.randn(*shape)
        torch.testing.assert_close(fn(x), torch.sigmoid(x) * x)
    assert [[r.domain for r in c.regions] for _, c in graphs] == [[(4, 6)], [(5, 3)]]
    assert [c.vm_calls for _, c in graphs] == [2, 1]
    x = torch.randn(4, 6)
    gm = make_fx(lambda t: torch.sigmoid(t) * t, tracing_mode="symbolic")(x)
    c = compile_graph(gm, [x])
    assert c.regions == []
    assert all("dynamic shape" in why for _, why in c.fallbacks)
