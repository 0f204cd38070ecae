"""sci-protenix's Pairformer modules against Protenix 2.0.0's own: each of ours loads Protenix's
state dict with strict=True (in `twin`) and gives Protenix's output on the same inputs, whole
and chunked. Eval mode, fp32; tolerance rtol 1e-5 / atol 2e-5 per module and 5e-5 for blocks and
stacks (the fused attention's float32 softmax vs Protenix's composite, values up to ~10).

Masks keep at least one key in every row and column: where a row keeps none, ours gives a zero
update and Protenix's -1e9 bias the mean of the values (documented in the README)."""

from __future__ import annotations

import pytest
import torch

from sci_protenix import (
    AttentionPairBias,
    PairformerBlock,
    PairformerStack,
    Transition,
    TriangleAttention,
    TriangleMultiplicationIncoming,
    TriangleMultiplicationOutgoing,
    triangle,
)
from sci_protenix.chunking import apply_plan
from sci_protenix.memory_plan import MemoryPlan

MODULE = {"rtol": 1e-5, "atol": 2e-5}
STACKED = {"rtol": 1e-5, "atol": 5e-5}
N, CZ, CS = 12, 16, 16
CHUNKS = [None, 1, 5, N + 3]


def _pair(batch=(2,)):
    return torch.randn(*batch, N, N, CZ)


def _mask(batch=(2,)):
    mask = (torch.rand(*batch, N, N) > 0.3).float()
    mask[..., 0] = 1.0
    mask[..., 0, :] = 1.0
    return mask


@pytest.mark.parametrize(
    "name", ["TriangleMultiplicationOutgoing", "TriangleMultiplicationIncoming"]
)
@pytest.mark.parametrize("with_mask", [False, True])
def test_triangle_multiplication(px, twin, name, with_mask) -> None:
    ours_cls = {
        "TriangleMultiplicationOutgoing": TriangleMultiplicationOutgoing,
        "TriangleMultiplicationIncoming": TriangleMultiplicationIncoming,
    }[name]
    theirs, ours = twin(getattr(px.triangular, name), ours_cls, c_z=CZ, c_hidden=12)
    z = _pair()
    mask = _mask() if with_mask else None
    with torch.no_grad():
        expected = theirs(z, mask=mask)
        for size in CHUNKS:
            torch.testing.assert_close(ours(z, mask=mask, chunk_size=size), expected, **MODULE)
        # in-place inference: Protenix's and ours both leave z + update in z
        mine, their_z = z.clone(), z.clone()
        theirs(their_z, mask=mask, inplace_safe=True, _add_with_inplace=True, _inplace_chunk_size=4)
        ours(mine, mask=mask, inplace_safe=True, _add_with_inplace=True, _inplace_chunk_size=4)
        torch.testing.assert_close(mine, their_z, **MODULE)
        torch.testing.assert_close(mine, z + expected, **MODULE)


@pytest.mark.parametrize("starting", [True, False])
@pytest.mark.parametrize("with_mask", [False, True])
def test_triangle_attention(px, twin, starting, with_mask) -> None:
    theirs, ours = twin(
        px.triangular.TriangleAttention,
        TriangleAttention,
        c_in=CZ,
        c_hidden=4,
        no_heads=4,
        starting=starting,
    )
    z = _pair()
    mask = _mask() if with_mask else None
    with torch.no_grad():
        for size in CHUNKS:
            expected = theirs(z, mask=mask, chunk_size=size)
            torch.testing.assert_close(ours(z, mask=mask, chunk_size=size), expected, **MODULE)


@pytest.mark.parametrize("starting", [True, False])
def test_triangle_attention_soft_mask(px, twin, starting) -> None:
    """Mask values between 0 and 1 mask their key, as Protenix's ``inf * (mask - 1)`` bias."""
    theirs, ours = twin(
        px.triangular.TriangleAttention,
        TriangleAttention,
        c_in=CZ,
        c_hidden=4,
        no_heads=2,
        starting=starting,
    )
    z, mask = _pair(), _mask()
    below_one = torch.tensor([0.0, 0.5, 1 - 2**-24])  # the last: float32's largest below 1
    soft = torch.where(mask == 1, mask, below_one[torch.randint(3, mask.shape)])
    with torch.no_grad():
        for size in (None, 5):
            expected = theirs(z, mask=soft, chunk_size=size)
            torch.testing.assert_close(ours(z, mask=soft, chunk_size=size), expected, **MODULE)
            torch.testing.assert_close(
                ours(z, mask=mask.bool(), chunk_size=size), expected, **MODULE
            )


def test_triangle_attention_node_classes(px, twin) -> None:
    from sci_protenix.triangle import TriangleAttentionEndingNode

    theirs, ours = twin(
        px.triangular.TriangleAttentionEndingNode,
        TriangleAttentionEndingNode,
        c_in=CZ,
        c_hidden=4,
        no_heads=2,
    )
    z, mask = _pair(), _mask()
    with torch.no_grad():
        torch.testing.assert_close(ours(z, mask=mask, chunk_size=5), theirs(z, mask=mask), **MODULE)


@pytest.mark.parametrize(
    ("name", "args", "kwargs"),
    [
        ("TriangleAttentionEndingNode", (CZ, 4, 2), {"starting": False, "inf": 1e4}),
        ("TriangleAttentionStartingNode", (CZ, 4, 2, True, 1e4), {}),
        ("TriangleMultiplicationOutgoing", (CZ, 12), {"_outgoing": True}),
        ("TriangleMultiplicationIncoming", (CZ, 12), {"_outgoing": False}),
    ],
)
def test_node_and_direction_classes_take_protenix_constructor_calls(
    px, twin, name, args, kwargs
) -> None:
    """Protenix's partialmethod keywords (``starting``, ``_outgoing``) and positions."""
    theirs, ours = twin(getattr(px.triangular, name), getattr(triangle, name), *args, **kwargs)
    z, mask = _pair(), _mask()
    with torch.no_grad():
        torch.testing.assert_close(ours(z, mask=mask), theirs(z, mask=mask), **MODULE)


@pytest.mark.parametrize("shape", [(N, CS), (2, N, N, CZ), (0, 0, CZ), (2, 0, CZ), (0, CS)])
def test_transition(px, twin, shape) -> None:
    theirs, ours = twin(px.primitives.Transition, Transition, c_in=shape[-1], n=4)
    x = torch.randn(*shape)
    with torch.no_grad():
        expected = theirs(x)
        for size in CHUNKS:
            torch.testing.assert_close(ours(x, chunk_size=size), expected, **MODULE)
            target = x.clone()  # in place: x + update left in x
            ours(target, chunk_size=size, inplace_safe=True, _add_with_inplace=True)
            torch.testing.assert_close(target, x + expected, **MODULE)


@pytest.mark.parametrize("has_s", [False, True])
def test_attention_pair_bias(px, twin, has_s) -> None:
    kwargs = {"has_s": has_s, "create_offset_ln_z": not has_s, "n_heads": 4, "c_a": CS}
    theirs, ours = twin(
        px.transformer.AttentionPairBias, AttentionPairBias, c_s=8, c_z=CZ, **kwargs
    )
    a, s, z = torch.randn(2, N, CS), torch.randn(2, N, 8), _pair()
    with torch.no_grad():
        expected = theirs(a=a, s=s if has_s else None, z=z)
        for size in CHUNKS:
            got = ours(a=a, s=s if has_s else None, z=z, chunk_size=size)
            torch.testing.assert_close(got, expected, **MODULE)


@pytest.mark.parametrize("window", [{"n_queries": 4}, {"n_keys": 8}])
def test_attention_pair_bias_with_one_window_size_is_global_as_protenix(px, twin, window) -> None:
    """Protenix runs global attention unless both ``n_queries`` and ``n_keys`` are given; ours
    raised a ValueError for one alone."""
    kwargs = {"n_heads": 4, "c_a": CS, "c_s": 8, "c_z": CZ}
    theirs, ours = twin(px.transformer.AttentionPairBias, AttentionPairBias, **kwargs)
    a, s, z = torch.randn(2, N, CS), torch.randn(2, N, 8), _pair()
    with torch.no_grad():
        torch.testing.assert_close(ours(a, s, z, **window), theirs(a, s, z, **window), **MODULE)


BLOCK = {
    "n_heads": 4,
    "c_z": CZ,
    "c_s": CS,
    "c_hidden_mul": 12,
    "c_hidden_pair_att": 4,
    "no_heads_pair": 4,
    "num_intermediate_factor": 2,
}


@pytest.mark.parametrize("with_mask", [False, True])
def test_pairformer_block(px, twin, with_mask) -> None:
    theirs, ours = twin(px.pairformer.PairformerBlock, PairformerBlock, **BLOCK)
    s, z = torch.randn(2, N, CS), _pair()
    mask = _mask() if with_mask else None
    with torch.no_grad():
        expected = theirs(s, z, mask)
        for size in CHUNKS:
            torch.testing.assert_close(ours(s, z, mask, chunk_size=size), expected, **STACKED)
        # in-place inference on both sides (each overwrites its own copy of z)
        their_s, their_z = theirs(s, z.clone(), mask, inplace_safe=True, chunk_size=4)
        our_s, our_z = ours(s, z.clone(), mask, inplace_safe=True, chunk_size=4)
    torch.testing.assert_close((our_s, our_z), (their_s, their_z), **STACKED)
    torch.testing.assert_close((our_s, our_z), expected, **STACKED)


def test_pairformer_stack(px, twin) -> None:
    kwargs = {"n_blocks": 2, "n_heads": 4, "c_z": CZ, "c_s": CS, "num_intermediate_factor": 2}
    theirs, ours = twin(px.pairformer.PairformerStack, PairformerStack, **kwargs)
    s, z, mask = torch.randn(N, CS), _pair(()), _mask(())
    with torch.no_grad():
        expected = theirs(s, z, mask)
        for size in CHUNKS:
            torch.testing.assert_close(ours(s, z, mask, chunk_size=size), expected, **STACKED)
        plan = MemoryPlan(tri_mul=5, tri_att=3, transition=4, pair_bias=2, inplace=True)
        got = apply_plan(ours, plan)(s, z.clone(), mask)
    torch.testing.assert_close(got, expected, **STACKED)


def test_pairformer_stack_gradients(px, twin) -> None:
    """Training gradients (dropout 0: the two draw different masks) equal Protenix's, with our
    selective recompute and chunks against its plain autograd."""
    kwargs = {"n_blocks": 2, "n_heads": 4, "c_z": CZ, "c_s": CS, "dropout": 0.0}
    theirs, ours = twin(px.pairformer.PairformerStack, PairformerStack, **kwargs)
    apply_plan(ours.train(), MemoryPlan(recompute="selective", tri_mul=5, tri_att=3))
    theirs.train()
    inputs = torch.randn(N, CS), _pair(()), _mask(())
    grads = []
    for module in (theirs, ours):
        s, z = (t.clone().requires_grad_() for t in inputs[:2])
        out_s, out_z = module(s, z, inputs[2])
        ((out_s**2).sum() + (out_z**2).sum()).backward()
        grads.append([s.grad, z.grad, *(p.grad for _, p in sorted(module.named_parameters()))])
    # gradients sum terms up to their largest value and may cancel: atol is relative to it
    scale = max(float(g.abs().max()) for g in grads[0])
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-5 * scale)


def test_pairformer_block_hidden_scale_up(px, twin) -> None:
    kwargs = {"n_heads": 4, "c_z": CZ, "c_s": 0, "c_hidden_pair_att": 4, "hidden_scale_up": True}
    theirs, ours = twin(px.pairformer.PairformerBlock, PairformerBlock, **kwargs)
    z, mask = _pair(), _mask()
    with torch.no_grad():
        expected = theirs(None, z, mask)
        torch.testing.assert_close(ours(None, z, mask, chunk_size=5), expected, **STACKED)
