"""Transition (AF3 algorithm 11): the SwiGLU formula is the oracle; chunked over rows equals
whole (fp32, rtol 1e-5 / atol 1e-6: chunking splits no sum); plan; in-place inference;
gradients; bad inputs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from sci_protenix import Transition
from sci_protenix.chunking import apply_plan
from sci_protenix.memory_plan import MemoryPlan
from sci_protenix.transition import row_blocks
from spore.memory import peak

TOL = {"rtol": 1e-5, "atol": 1e-6}


def formula(t: Transition, x: torch.Tensor) -> torch.Tensor:
    y = F.layer_norm(x, (t.c_in,), t.layernorm1.weight, t.layernorm1.bias, 1e-5)
    hidden = F.silu(y @ t.linear_no_bias_a.weight.T) * (y @ t.linear_no_bias_b.weight.T)
    return hidden @ t.linear_no_bias.weight.T


@pytest.mark.parametrize("shape", [(7, 6), (2, 7, 7, 6), (3, 5, 6), (2, 0, 6), (0, 6)])
def test_transition_equals_formula_at_every_chunk_size(shape, randomize) -> None:
    t = randomize(Transition(c_in=6, n=2))
    x = torch.randn(*shape)
    with torch.no_grad():
        expected = formula(t, x)
        for size in (None, 1, 3, 100):
            torch.testing.assert_close(t(x, chunk_size=size), expected, **TOL)


def test_transition_plan_chunks_rows(randomize) -> None:
    t = apply_plan(randomize(Transition(c_in=4, n=2)), MemoryPlan(transition=3))
    calls = []
    t.linear_no_bias.register_forward_hook(lambda *args: calls.append(args[1][0].shape[:-1]))
    x = torch.randn(2, 5, 5, 4)  # 10 rows of 5 positions
    with torch.no_grad():
        torch.testing.assert_close(t(x, chunk_size=None), formula(t, x), **TOL)
    assert len(calls) == math.ceil(10 / 3)
    assert calls[0] == (3, 5)


def test_transition_inplace_equals_out_of_place(randomize) -> None:
    t = randomize(Transition(c_in=4, n=3))
    x = torch.randn(6, 6, 4)
    with torch.no_grad():
        expected = x + t(x)
        for size in (None, 1, 4):
            target = x.clone()
            got = t(target, chunk_size=size, inplace_safe=True, _add_with_inplace=True)
            assert got.data_ptr() == target.data_ptr()
            torch.testing.assert_close(target, expected, **TOL)


@pytest.mark.parametrize("size", [None, 1, 4, 5, 7, 100])
def test_transition_inplace_into_a_non_contiguous_x(size, randomize) -> None:
    """A strided x (rows i of a batch, transposed: no flat view) was left as it was and the sum
    came back new; it is updated in place, chunks spanning examples included."""
    t = randomize(Transition(c_in=4, n=3))
    x = torch.randn(2, 6, 6, 4)
    with torch.no_grad():
        expected = x + t(x)
        target = x.transpose(1, 2).contiguous().transpose(1, 2)
        got = t(target, chunk_size=size, inplace_safe=True, _add_with_inplace=True)
    assert got is target
    torch.testing.assert_close(target, expected, **TOL)


def test_transition_inplace_into_a_non_contiguous_x_makes_no_whole_copy(randomize) -> None:
    t = randomize(Transition(c_in=8, n=2))
    x = torch.randn(2, 32, 32, 8).transpose(1, 2)
    with torch.no_grad(), peak() as measured:
        t(x, chunk_size=2, inplace_safe=True, _add_with_inplace=True)
    assert measured.peak_bytes < 0.5 * x.nbytes  # x + update made 2 x


@pytest.mark.parametrize("dims", [(), (7,), (2, 3), (3, 1, 4), (2, 0, 3), (4, 3, 2)])
def test_row_blocks_are_the_flattened_rows_in_order(dims) -> None:
    index = torch.arange(math.prod(dims)).reshape(*dims, 1, 1)
    flat = index.flatten().tolist()
    for start in range(len(flat) + 1):
        for stop in range(start, len(flat) + 1):
            blocks = row_blocks(dims, start, stop)
            assert len(blocks) <= max(1, 2 * len(dims) - 1)
            got = [i for b in blocks for i in index[b].flatten().tolist()]
            assert got == flat[start:stop]


def test_transition_gradients_through_chunks(randomize) -> None:
    t = randomize(Transition(c_in=4, n=2))
    x0 = torch.randn(5, 5, 4)
    grads = []
    for size in (None, 1, 2):
        t.zero_grad()
        x = x0.clone().requires_grad_()
        (t(x, chunk_size=size) ** 2).sum().backward()
        grads.append([x.grad, *(p.grad.clone() for p in t.parameters())])
    for other in grads[1:]:
        torch.testing.assert_close(other, grads[0], rtol=1e-5, atol=1e-6)


def test_transition_bad_inputs() -> None:
    t = Transition(c_in=4, n=2)
    with pytest.raises(ValueError, match="4 channels"):
        t(torch.randn(3, 5))
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        t(torch.randn(3, 4), chunk_size=-1)
