from __future__ import annotations

import io
from typing import ClassVar

import pytest
import torch

import spore
from spore.fallback import FallbackTensor


class Sharded(FallbackTensor):
    """A tensor carrying a sharding annotation: 'shard0' (rows split) or 'replicate'."""


def _placement(t) -> str:
    return t.meta["placement"] if isinstance(t, Sharded) else "replicate"


@Sharded.register(torch.ops.aten.mm.default)
def _mm(cls, func, args, kwargs):
    a, b = args
    out = func(*(t.unwrap() if isinstance(t, Sharded) else t for t in args))
    rows_split = _placement(a) == "shard0" and _placement(b) == "replicate"
    return cls(out, {"placement": "shard0" if rows_split else "replicate", "via": "mm"})


class Counting(FallbackTensor):
    seen: ClassVar[list[str]] = []

    @classmethod
    def __fallback__(cls, func, args, kwargs):
        cls.seen.append(str(func))
        return super().__fallback__(func, args, kwargs)


def test_annotation_propagates_through_matmul_and_elementwise() -> None:
    x = Sharded(torch.randn(4, 3), {"placement": "shard0"})
    w = torch.randn(3, 2)
    y = torch.relu(torch.mm(x, w) * 2 + 1)
    assert isinstance(y, Sharded)
    assert y.meta == {"placement": "shard0", "via": "mm"}
    torch.testing.assert_close(y.unwrap(), torch.relu(x.unwrap() @ w * 2 + 1))
    r = torch.mm(w.t(), Sharded(torch.randn(3, 5), {"placement": "shard0"}))
    assert r.meta["placement"] == "replicate"


def test_handlers_win_over_the_fallback_and_the_fallback_sees_the_rest() -> None:
    Counting.seen.clear()
    t = Counting(torch.ones(2, 2))
    (t.exp() + t).sum()
    assert Counting.seen == ["aten.exp.default", "aten.add.Tensor", "aten.sum.default"]

    @Counting.register(torch.ops.aten.exp)
    def _exp(cls, func, args, kwargs):
        return cls(torch.zeros_like(args[0].unwrap()))

    Counting.seen.clear()
    assert t.exp().unwrap().sum().item() == 0.0
    assert Counting.seen == []
    del Counting._spore_handlers[torch.ops.aten.exp]


def test_autograd_through_subclass_ops_matches_plain() -> None:
    base = torch.randn(4, 3)
    w = torch.randn(3, 2, requires_grad=True)
    x = Sharded(base.clone().requires_grad_(), {"placement": "shard0"})
    (torch.mm(x, w).tanh() ** 2).sum().backward()
    w_plain = w.detach().clone().requires_grad_()
    x_plain = base.clone().requires_grad_()
    (torch.mm(x_plain, w_plain).tanh() ** 2).sum().backward()
    torch.testing.assert_close(_plain(w.grad), w_plain.grad)
    torch.testing.assert_close(_plain(x.grad), x_plain.grad)


def _plain(t):
    return t.unwrap() if isinstance(t, FallbackTensor) else t


def test_inplace_and_views() -> None:
    t = Sharded(torch.zeros(4), {"placement": "replicate"})
    same = t.add_(1)
    assert same is t
    assert t.unwrap().tolist() == [1.0] * 4
    view = t[1:3]
    assert isinstance(view, Sharded)
    assert view.meta == {"placement": "replicate"}
    view.mul_(5)
    assert t.unwrap().tolist() == [1.0, 5.0, 5.0, 1.0]


@pytest.mark.parametrize(
    "change",
    [
        lambda t: t.t_(),
        lambda t: t.transpose_(0, 1),
        lambda t: t.unsqueeze_(0),
        lambda t: t.unsqueeze_(1).squeeze_(1),
        lambda t: t.as_strided_((3, 2), (1, 3)),
        lambda t: t.resize_(6),
        lambda t: t.resize_(5, 4),  # grows the storage
        lambda t: t.resize_(0),
        lambda t: t.set_(torch.arange(8.0).view(2, 4)),
        lambda t: torch.add(torch.ones(4), 1, out=t.resize_(0)),  # out= grows to 4
    ],
    ids=[
        "t_",
        "transpose_",
        "unsqueeze_",
        "squeeze_",
        "as_strided_",
        "shrink",
        "grow",
        "empty",
        "set_",
        "out",
    ],
)
def test_inplace_shape_changes_reach_the_wrapper(change) -> None:
    plain = torch.arange(6.0).view(2, 3)
    wrapped = Sharded(plain.clone(), {"placement": "replicate"})
    assert change(wrapped) is wrapped
    change(plain)
    assert (wrapped.shape, wrapped.stride()) == (plain.shape, plain.stride())
    assert wrapped.storage_offset() == plain.storage_offset()
    assert wrapped.unwrap().shape == plain.shape
    if plain.numel() and plain.shape != (5, 4):  # a grown tensor's new elements are undefined
        torch.testing.assert_close((wrapped * 2).unwrap(), plain * 2)
    assert (wrapped + 1).shape == plain.shape


@pytest.mark.parametrize(
    "op",
    [
        lambda t: t.conj() * 2,
        lambda t: t.conj().imag,
        lambda t: t.conj().clone(),
        lambda t: t.conj().resolve_conj(),
        lambda t: torch._neg_view(t) + 1,
        lambda t: torch._neg_view(t.conj()).real,
        lambda t: t.conj() @ t.conj().T,
    ],
    ids=["mul", "imag", "clone", "resolve", "neg_view", "neg_conj_real", "matmul"],
)
def test_conjugate_and_negative_views_keep_their_bits(op) -> None:
    plain = torch.tensor([[1 + 2j, 3 - 1j], [-0.5 + 0.25j, 2j]])
    out = op(Sharded(plain.clone(), {"placement": "replicate"}))
    torch.testing.assert_close(out.unwrap().resolve_conj().resolve_neg(), op(plain).resolve_conj())


def test_gradient_through_a_conjugate_matches_plain() -> None:
    plain = torch.tensor([1 + 2j, 3 - 1j], requires_grad=True)
    wrapped = Sharded(plain.detach().clone(), {"placement": "replicate"}).requires_grad_()
    for t in (plain, wrapped):
        ((t.conj() * torch.tensor([1j, 2.0])) ** 2).real.sum().backward()
    torch.testing.assert_close(wrapped.grad.unwrap(), plain.grad)


def test_save_and_load_keep_data_and_meta() -> None:
    t = Sharded(torch.arange(3.0), {"placement": "shard0"})
    buf = io.BytesIO()
    torch.save(t, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded) is Sharded
    assert loaded.meta == {"placement": "shard0"}
    assert loaded.unwrap().tolist() == [0.0, 1.0, 2.0]


def test_a_weights_only_load_needs_only_the_subclass_allowed() -> None:
    """The docs said add_safe_globals([MyTensor]) was enough for torch.load(weights_only=True);
    it also needed spore.fallback._rebuild allowed. That rebuilds FallbackTensor subclasses
    only, and the subclass itself must still be allowed."""
    from spore.fallback import _rebuild

    buf = io.BytesIO()
    torch.save(Sharded(torch.arange(3.0), {"placement": "shard0"}).requires_grad_(), buf)
    buf.seek(0)
    with pytest.raises(Exception, match="Sharded"):
        torch.load(buf, weights_only=True)
    buf.seek(0)
    with torch.serialization.safe_globals([Sharded]):
        loaded = torch.load(buf, weights_only=True)
    assert type(loaded) is Sharded
    assert loaded.requires_grad
    assert loaded.meta == {"placement": "shard0"}
    assert loaded.unwrap().tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(TypeError, match="names <class 'dict'>, not a FallbackTensor subclass"):
        _rebuild(dict, torch.ones(1), {})


@pytest.mark.parametrize("requires_grad", [True, False])
def test_requires_grad_survives_rewrapping_and_save_and_load(requires_grad) -> None:
    wrapper = Sharded(torch.ones(2), {"placement": "shard0"}).requires_grad_(requires_grad)
    assert Sharded(wrapper).requires_grad is requires_grad
    buf = io.BytesIO()
    torch.save(wrapper, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded.requires_grad is requires_grad
    assert loaded.meta == {"placement": "shard0"}


def test_compiles_with_aot_autograd() -> None:
    x = Sharded(torch.randn(4, 3), {"placement": "shard0"})
    compiled = torch.compile(lambda a: (a * 2).sin(), backend="aot_eager", fullgraph=True)
    out = compiled(x)
    assert type(out) is Sharded
    assert out.meta == {"placement": "shard0"}
    torch.testing.assert_close(out.unwrap(), (x.unwrap() * 2).sin())


def test_deepcopy_of_a_view_and_of_a_module_holding_one() -> None:
    """deepcopy(w[2:]) raised (torch's deepcopy took the wrapper, at an offset, for a tensor
    with storage); views of one tensor stay views of one copy, and the metadata is copied."""
    import copy

    w = Sharded(torch.arange(6.0), {"shard": 1})
    a, b = copy.deepcopy([w[2:], w[:3]])
    assert torch.equal(a.unwrap(), torch.tensor([2.0, 3.0, 4.0, 5.0]))
    assert a.meta == {"shard": 1}
    assert a.meta is not w.meta
    a.unwrap().add_(10)  # the two copies still share one storage, not the original's
    assert b.unwrap()[2] == 12.0
    assert w.unwrap()[2] == 2.0
    leaf = Sharded(torch.ones(3, requires_grad=True))
    leaf.sum().backward()
    copied = copy.deepcopy(leaf)
    assert copied.requires_grad
    assert torch.equal(copied.grad, torch.ones(3))
    with pytest.raises(RuntimeError, match="graph leaves"):
        copy.deepcopy(leaf * 2)
    module = torch.nn.Linear(3, 2)  # a parameter wrapping a view at an offset, an attribute
    module.weight = torch.nn.Parameter(Sharded(torch.arange(9.0)[3:].view(2, 3)))
    module.weight.note = "kept"
    twin = copy.deepcopy(module)
    assert isinstance(twin.weight, torch.nn.Parameter)
    assert twin.weight.note == "kept"
    assert torch.equal(twin.weight.unwrap(), module.weight.unwrap())
    twin.weight = twin.weight  # still a parameter to the module


def test_setting_data_replaces_the_wrapped_tensor() -> None:
    """t.data = x changed the wrapper's shape, but the values were still the old ones."""
    t = Sharded(torch.ones(3))
    t.data = torch.zeros(5)
    assert t.shape == (5,)
    assert t.sum() == 0
    assert torch.equal(t.unwrap(), torch.zeros(5))
    t.data = Sharded(torch.full((2,), 2.0))
    assert torch.equal(t.unwrap(), torch.full((2,), 2.0))


@pytest.mark.parametrize("op", ["t_", "unsqueeze_"])
def test_compile_with_an_in_place_view_of_an_input(op) -> None:
    """dynamo breaks the graph on an in-place view of an input and runs it eagerly; its frame
    hook then traced __torch_dispatch__ as user code, which failed."""
    torch._dynamo.reset()
    x = torch.randn(2, 3)
    out = torch.compile(lambda a: getattr(a, op)(*(() if op == "t_" else (0,))), backend="eager")(
        Sharded(x.clone())
    )
    want = getattr(x.clone(), op)(*(() if op == "t_" else (0,)))
    assert out.shape == want.shape
    assert torch.equal(out.unwrap(), want)


def test_bad_input() -> None:
    with pytest.raises(TypeError, match=r"wraps a torch\.Tensor, got list"):
        Sharded([1, 2])  # type: ignore[arg-type]


class Strict(FallbackTensor):
    """A subclass no test registers a handler on."""


@pytest.mark.parametrize(
    ("op", "hint"),
    [
        (torch.add, r"never run \(did you mean torch\.ops\.aten\.add\?\)$"),
        (torch.Tensor.mul, r"never run \(did you mean torch\.ops\.aten\.mul\?\)$"),
        ("aten::mm.default", r"never run \(did you mean torch\.ops\.aten\.mm\?\)$"),
        (3, r"never run$"),
    ],
)
def test_registering_what_is_not_an_op_is_a_clear_error(op, hint) -> None:
    with pytest.raises(TypeError, match=rf"Strict\.register\(.*{hint}"):
        Strict.register(op)
    assert Strict._spore_handlers == {}


@torch.library.custom_op("spore_test_fallback::double", mutates_args=())
def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


class CustomOpHandled(FallbackTensor):
    """A subclass the test below registers a handler on for a ``torch.library.custom_op``."""


def test_register_takes_what_custom_op_returns_as_its_packet() -> None:
    @CustomOpHandled.register(_double)
    def _handler(cls, func, args, kwargs):
        return cls(func(args[0].unwrap()) + 1, {"via": "custom_op"})

    assert list(CustomOpHandled._spore_handlers) == [torch.ops.spore_test_fallback.double]
    out = _double(CustomOpHandled(torch.ones(2)))
    assert out.meta == {"via": "custom_op"}
    assert torch.equal(out.unwrap(), torch.full((2,), 3.0))


def test_exported_from_spore() -> None:
    assert spore.FallbackTensor is FallbackTensor
