"""GELU, SiLU·mul and SwiGLU passes on real Hugging Face MLPs, compiled with mfusion vs eager.

Tolerance (largest absolute difference over the largest absolute eager value): float32 1e-5
(the ops and Inductor's code differ from eager's by a few ulps); bfloat16 2e-2 (the spore ops
and Inductor's fused code round once from float32, eager bfloat16 rounds after each op of a
hand-written formula; a few bfloat16 ulps, 2**-8 each).

Counts per mode: in inference the forward graph holds one fused op per activation. In a
forward+backward compile the forward graph still matches (these patterns save only their
inputs for backward); the backward graph holds the decomposed derivative, in which the
partitioner recomputes ``silu(a)`` for ``grad_b = grad * silu(a)``. In float32 that product is
itself a SiLU·mul and is rewritten too; in bfloat16 the float32 upcast of ``a`` inside it also
feeds ``grad_a``, so the matcher (correctly) leaves it.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import BertConfig, GPT2Config, LlamaConfig, Phi3Config
from transformers.activations import FastGELUActivation, NewGELUActivation
from transformers.models.bert.modeling_bert import BertIntermediate
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.phi3.modeling_phi3 import Phi3MLP

from mfusion.passes.activations import PASSES

HIDDEN, FFN = 32, 64
GELU = "spore.gelu.default"
SILU_MUL = "spore.silu_mul.default"
SWIGLU = "spore.swiglu.default"


def _inputs(dtype: torch.dtype, *shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(*shape, generator=g) * 2).to(dtype)


@pytest.fixture
def check_against_eager(
    mfusion_compile: Callable[..., Any], assert_rel_close: Callable[..., None]
) -> Callable[..., Any]:
    """``check_against_eager(module, x, train)``: compile ``module`` with mfusion, compare output
    (and grads of x and every parameter for a random upstream gradient when ``train``) with
    eager; return the compile record."""

    def check(module: torch.nn.Module, x: torch.Tensor, train: bool) -> Any:
        eager = copy.deepcopy(module)
        if not train:
            with torch.no_grad():
                compiled = mfusion_compile(module, x)
                assert_rel_close(compiled.outputs, eager(x), "output")
            return compiled
        x_c, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
        compiled = mfusion_compile(module, x_c)
        want = eager(x_e)
        assert_rel_close(compiled.outputs, want, "output")
        upstream = _inputs(want.dtype, *want.shape)
        compiled.outputs.backward(upstream)
        want.backward(upstream)
        assert_rel_close(x_c.grad, x_e.grad, "grad of x")
        for (name, p_c), p_e in zip(module.named_parameters(), eager.parameters(), strict=True):
            assert_rel_close(p_c.grad, p_e.grad, f"grad of {name}")
        return compiled

    return check


@pytest.mark.parametrize(
    ("dtype", "train", "backward_count"),
    [
        pytest.param(torch.float32, True, 1, id="fp32-train"),
        pytest.param(torch.bfloat16, True, 0, id="bf16-train"),
    ],
)
def test_llama_mlp_gate_is_one_silu_mul(check_against_eager, dtype, train, backward_count) -> None:
    """Backward: float32 grad_up = g * silu(gate) is a SiLU·mul of the saved gate; in bfloat16
    the recomputed silu's float32 upcast of gate also feeds the derivative, so it stays."""
    mlp = LlamaMLP(LlamaConfig(hidden_size=HIDDEN, intermediate_size=FFN)).to(dtype)
    compiled = check_against_eager(mlp, _inputs(dtype, 2, 5, HIDDEN), train)
    assert len(compiled.graphs) == 2
    assert compiled.spore_ops(graph=0) == {SILU_MUL: 1}
    assert compiled.spore_ops(graph=1) == ({SILU_MUL: backward_count} if backward_count else {})


def test_phi3_fused_gate_up_is_one_swiglu(check_against_eager) -> None:
    dtype = torch.bfloat16
    mlp = Phi3MLP(Phi3Config(hidden_size=HIDDEN, intermediate_size=FFN)).to(dtype)
    compiled = check_against_eager(mlp, _inputs(dtype, 2, 5, HIDDEN), False)
    assert compiled.spore_ops(graph=0) == {SWIGLU: 1}


def test_swiglu_gated_by_the_second_half_is_not_swiglu(assert_rel_close) -> None:
    """spore.swiglu gates with the first half; gating with the second is a silu_mul."""

    def second_half_gates(x: torch.Tensor) -> torch.Tensor:
        up, gate = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    x = _inputs(torch.float32, 4, 2 * FFN)
    gm = _traced_with_passes(second_half_gates, x)
    assert _spore_targets(gm) == [SILU_MUL]
    assert_rel_close(gm(x), second_half_gates(x), "output")


def _gpt2_mlp() -> torch.nn.Module:
    config = GPT2Config(n_embd=HIDDEN, activation_function="gelu_new", resid_pdrop=0.0)
    return GPT2MLP(FFN, config)


def _bert_intermediate() -> torch.nn.Module:
    config = BertConfig(hidden_size=HIDDEN, intermediate_size=FFN, hidden_act="gelu")
    return BertIntermediate(config)


@pytest.mark.parametrize(
    ("build", "dtype", "train"),
    [
        pytest.param(_gpt2_mlp, torch.float32, True, id="gpt2-tanh-by-hand-fp32-train"),
        pytest.param(_gpt2_mlp, torch.bfloat16, False, id="gpt2-tanh-by-hand-bf16-forward"),
        pytest.param(_bert_intermediate, torch.bfloat16, True, id="bert-exact-bf16-train"),
    ],
)
def test_gelu_of_a_real_mlp_is_one_spore_gelu(check_against_eager, build, dtype, train) -> None:
    """GELU saves only its input for backward, so the training forward graph matches too."""
    module = build().to(dtype).eval()
    compiled = check_against_eager(module, _inputs(dtype, 2, 5, HIDDEN), train)
    assert compiled.spore_ops() == {GELU: 1}


def test_gelu_approximations_map_to_the_op_modes(mfusion_compile, assert_rel_close) -> None:
    def both(x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x) + F.gelu(x.sin(), approximate="tanh")

    x = _inputs(torch.float32, 4, FFN)
    with torch.no_grad():
        compiled = mfusion_compile(both, x)
    assert_rel_close(compiled.outputs, both(x), "output")
    assert compiled.spore_ops() == {GELU: 2}
    gelus = [n for n in _traced_with_passes(both, x).graph.nodes if str(n.target) == GELU]
    modes = sorted(n.args[1] if len(n.args) > 1 else "none" for n in gelus)  # "none": default
    assert modes == ["none", "tanh"]


def _spore_targets(gm: torch.fx.GraphModule) -> list[str]:
    return sorted(str(n.target) for n in gm.graph.nodes if str(n.target).startswith("spore."))


def _traced_with_passes(fn: Callable[..., Any], *args: torch.Tensor) -> torch.fx.GraphModule:
    """``fn`` traced to the post-grad stage's aten graph, then the activation passes."""
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes.post_grad import view_to_reshape
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(fn, select_decomp_table(), tracing_mode="fake")(*args)
    view_to_reshape(gm)
    for pass_ in PASSES:
        pass_(gm)
    return gm


@pytest.mark.parametrize(
    ("fn", "nargs", "op"),
    [
        pytest.param(F.gelu, 1, GELU, id="gelu"),
        pytest.param(lambda a, b: F.silu(a) * b, 2, SILU_MUL, id="silu_mul"),
    ],
)
def test_bf16_upcast_and_downcast_are_absorbed(assert_rel_close, fn, nargs, op) -> None:
    """F.gelu/F.silu on bf16 decompose between casts to fp32 and back; the op takes bf16 as
    it is (it computes in fp32 and rounds once: the same result)."""
    args = [_inputs(torch.bfloat16, 4, FFN) for _ in range(nargs)]
    gm = _traced_with_passes(fn, *args)
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [op]
    assert_rel_close(gm(*args), fn(*args), "output")


def _swiglu(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize(
    ("fn", "nargs", "ops"),
    [
        pytest.param(NewGELUActivation(), 1, [GELU], id="gpt2-gelu"),
        pytest.param(lambda a, b: F.silu(a) * b, 2, [SILU_MUL], id="silu_mul"),
        pytest.param(_swiglu, 1, [SWIGLU], id="swiglu"),
    ],
)
def test_16_bit_forms_left_alone_when_inductor_emulates_casts(fn, nargs, ops) -> None:
    """With ``emulate_precision_casts`` Inductor rounds as eager does, where the op rounds
    once: bf16 forms stay Inductor's (the rewrite differed from eager in 4513 of 16384 values
    of a bf16 silu * b); fp32 ones are still rewritten."""
    from torch._inductor import config

    with config.patch(emulate_precision_casts=True):
        bf16 = [_inputs(torch.bfloat16, 4, FFN) for _ in range(nargs)]
        assert _spore_targets(_traced_with_passes(fn, *bf16)) == []
        fp32 = [_inputs(torch.float32, 4, FFN) for _ in range(nargs)]
        assert _spore_targets(_traced_with_passes(fn, *fp32)) == ops


def _gelu_tanh_other_constant(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.0447 * x.pow(3.0))))


def _gelu_erf_other_scale(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5 * (1.0 + torch.erf(x / 1.41))


@pytest.mark.parametrize(
    "fn",
    [_gelu_tanh_other_constant, _gelu_erf_other_scale, FastGELUActivation()],
    ids=["tanh-0.0447", "erf-over-1.41", "hf-fast-gelu-0.7978845608"],
)
def test_formulas_with_other_constants_are_left_alone(fn) -> None:
    x = _inputs(torch.float32, 4, FFN)
    gm = _traced_with_passes(fn, x)
    assert _spore_targets(gm) == []
    torch.testing.assert_close(gm(x), fn(x), rtol=0, atol=0)


def test_integer_input_is_left_alone() -> None:
    """GPT-2's GELU on an int tensor promotes to float: not a GELU of x's dtype."""
    x = torch.arange(-8, 8, dtype=torch.int32).reshape(4, 4)
    gelu = NewGELUActivation()
    gm = _traced_with_passes(gelu, x)
    assert _spore_targets(gm) == []
    torch.testing.assert_close(gm(x), gelu(x), rtol=0, atol=0)


def test_passes_are_idempotent_on_real_graphs(mfusion_compile) -> None:
    """A second run of every activation pass on the compiled post-grad graph changes nothing."""
    llama = LlamaMLP(LlamaConfig(hidden_size=HIDDEN, intermediate_size=FFN))
    phi3 = Phi3MLP(Phi3Config(hidden_size=HIDDEN, intermediate_size=FFN))

    def mlp_and_gelu(x: torch.Tensor) -> torch.Tensor:
        return llama(NewGELUActivation()(x)) + phi3(x)

    x = _inputs(torch.float32, 2, 5, HIDDEN)
    with torch.no_grad():
        compiled = mfusion_compile(mlp_and_gelu, x, rerun=PASSES)
    assert compiled.reruns == [([0, 0, 0], {GELU: 1, SILU_MUL: 1, SWIGLU: 1}, True)]


def test_mfusion_disable_gelu_leaves_gelu(check_against_eager, monkeypatch) -> None:
    monkeypatch.setenv("MFUSION_DISABLE", "gelu")
    module = _gpt2_mlp().eval()
    x = _inputs(torch.float32, 2, 5, HIDDEN)
    compiled = check_against_eager(module, x, train=False)
    assert compiled.spore_ops() == {}
    assert compiled.count("aten.tanh.default") == 1
