"""Real blocks and a tiny Hugging Face Llama under ``backend="dvm"``: outputs and gradients
equal eager, and the regions really ran on the VM; every region also built by the Python
lowering rules alone and checked to be the same (``native_checked``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dvm.backend import make_backend
from dvm.cluster import ALONE
from dvm.lower import KEPT_WHOLE

pytestmark = pytest.mark.usefixtures("native_checked")

aten = torch.ops.aten


def _compile(fn):
    graphs = []
    return torch.compile(fn, backend=make_backend(lambda kind, c: graphs.append((kind, c)))), graphs


TOL = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


class GeluMLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class SiluGate(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(d, 2 * d, bias=False), nn.Linear(d, 2 * d, bias=False)

    def forward(self, x):
        return F.silu(self.gate(x)) * self.up(x)


class Softmax(nn.Module):
    def forward(self, x):
        return torch.softmax(x * 0.5, dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


BLOCKS = {
    "gelu_mlp": lambda d: GeluMLP(d),
    "silu_gate": lambda d: SiluGate(d),
    "softmax": lambda d: Softmax(),
    "rmsnorm": lambda d: RMSNorm(d),
    "layernorm": lambda d: nn.LayerNorm(d),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(BLOCKS))
def test_block_forward_backward(name, dtype):
    torch.manual_seed(0)
    d = 24
    block = BLOCKS[name](d).to(dtype)
    x = torch.randn(3, 5, d, dtype=dtype)
    xe = x.clone().requires_grad_()
    xc = x.clone().requires_grad_()
    want = block(xe)
    (want.float() * torch.linspace(-1, 1, want.shape[-1])).sum().backward()
    grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    compiled, graphs = _compile(block)
    got = compiled(xc)
    (got.float() * torch.linspace(-1, 1, got.shape[-1])).sum().backward()
    tol = TOL[dtype]
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(xc.grad, xe.grad, **tol)
    for p, g in zip(block.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, g, **tol)
    kinds = {kind for kind, _ in graphs}
    assert kinds == {"forward", "backward"}
    for kind, c in graphs:
        assert c.executor == "vm"
        if name == "gelu_mlp":
            # the only pointwise op each way is the GELU or its backward, one eager kernel
            # each: left to eager, whole
            op = aten.gelu.default if kind == "forward" else aten.gelu_backward.default
            assert [(n.target, why) for n, why in c.fallbacks if n.target == op] == [(op, ALONE)], (
                c.fallbacks
            )
            assert c.regions == []
            continue
        if name == "layernorm":  # PyTorch's kernel each way, whole (see the test below)
            op = aten.native_layer_norm if kind == "forward" else aten.native_layer_norm_backward
            assert [n.target for n, why in c.fallbacks if why == KEPT_WHOLE[op.default]] == [
                op.default
            ], c.fallbacks
            assert c.regions == []
            continue
        assert len(c.regions) >= 1, (kind, c.fallbacks)
        assert c.vm_calls >= len(c.regions), kind  # every region ran on the VM
        assert c.eager_calls == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layer_norm_stays_whole_between_fused_ops(dtype):
    """LayerNorm and its backward stay PyTorch's kernels, with the reason recorded; the ops
    before and after it fuse into regions of their own; results and gradients equal eager."""
    torch.manual_seed(0)
    norm = nn.LayerNorm(24).to(dtype)

    def fn(x):
        return torch.tanh(norm(x * 2.0 + 1.0)) * 3.0

    x = torch.randn(3, 5, 24, dtype=dtype)
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = fn(xe)
    want.float().sum().backward()
    grads = [p.grad.clone() for p in norm.parameters()]
    norm.zero_grad()
    compiled, graphs = _compile(fn)
    got = compiled(xc)
    got.float().sum().backward()
    tol = TOL[dtype]
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(xc.grad, xe.grad, **tol)
    for p, g in zip(norm.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, g, **tol)
    assert [kind for kind, _ in graphs] == ["forward", "backward"]
    for kind, c in graphs:
        op = aten.native_layer_norm if kind == "forward" else aten.native_layer_norm_backward
        whole = [n.target for n, why in c.fallbacks if why == KEPT_WHOLE[op.default]]
        assert whole == [op.default], (kind, c.fallbacks)
        fused = [n.target for r in c.regions for n in r.nodes]
        assert aten.mul.Tensor in fused, (kind, c.fallbacks)
        assert not {aten.rsqrt.default, aten.var_mean.correction} & set(fused), kind
        assert c.vm_calls >= len(c.regions) >= 1, kind


@pytest.mark.parametrize("log", [False, True])
def test_softmax_alone_stays_whole_and_fuses_with_ops_around_it(log):
    """Softmax and log-softmax (forward and backward) are one eager kernel each: alone they stay
    that kernel, with ops around them they join their region; either way results and grads
    equal eager."""
    op = torch.log_softmax if log else torch.softmax
    targets = (
        {aten._log_softmax.default, aten._log_softmax_backward_data.default}
        if log
        else {aten._softmax.default, aten._softmax_backward_data.default}
    )
    for fn, fused in [(lambda x: op(x, -1), False), (lambda x: op(x * 2, -1) * 3, True)]:
        compiled, graphs = _compile(fn)
        x = torch.randn(4, 10, requires_grad=True)
        xe = x.detach().clone().requires_grad_()
        weights = torch.linspace(-1, 1, 10)
        (compiled(x) * weights).sum().backward()
        want = fn(xe)
        (want * weights).sum().backward()
        torch.testing.assert_close(compiled(x), want)
        torch.testing.assert_close(x.grad, xe.grad)
        assert [kind for kind, _ in graphs] == ["forward", "backward"]
        for kind, c in graphs:
            in_regions = {n.target for r in c.regions for n in r.nodes} & targets
            alone = {n.target for n, why in c.fallbacks if why == ALONE} & targets
            if fused:
                assert len(in_regions) == 1, (kind, c.fallbacks)
                assert c.vm_calls >= 1
            else:
                assert c.regions == [], kind
                assert len(alone) == 1, (kind, c.fallbacks)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_tiny_llama_forward_backward(attention, tiny_llama):
    model = tiny_llama(attention)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    want_loss = out.loss.detach()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    compiled, graphs = _compile(model)
    got = compiled(input_ids=ids, labels=ids)
    got.loss.backward()
    torch.testing.assert_close(got.loss.detach(), want_loss, atol=1e-5, rtol=1e-5)
    scale = max(g.abs().max().item() for g in want.values())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], atol=1e-5 * scale, rtol=1e-4, msg=n)
    fw = [c for kind, c in graphs if kind == "forward"]
    bw = [c for kind, c in graphs if kind == "backward"]
    assert fw
    assert bw
    regions = {
        kind: sum(len(c.regions) for k, c in graphs if k == kind)
        for kind in ("forward", "backward")
    }
    vm_calls = sum(c.vm_calls for _, c in graphs)
    # 2 layers x (2 RMSNorms, SiLU gate, softmax, RoPE) + the final norm: many regions each way
    assert regions["forward"] >= 8, regions
    assert regions["backward"] >= 8, regions
    assert vm_calls == sum(regions.values())
    assert all(c.eager_calls == 0 for _, c in graphs)


ENCODER = {  # BERT's and DeBERTa-v2's config
    "vocab_size": 128,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 32,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}

TINY_HF = {  # name: (config class, model class, config, the batch's kind)
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        {
            "vocab_size": 128,
            "n_embd": 32,
            "n_layer": 2,
            "n_head": 2,
            "n_positions": 32,
            "bos_token_id": 0,
            "eos_token_id": 0,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
        },
        "tokens",
    ),
    "t5": (
        "T5Config",
        "T5ForConditionalGeneration",
        {
            "vocab_size": 128,
            "d_model": 32,
            "d_ff": 64,
            "d_kv": 16,
            "num_layers": 2,
            "num_heads": 2,
            "decoder_start_token_id": 0,
            "dropout_rate": 0.0,
        },
        "tokens",
    ),
    "bert": (
        "BertConfig",
        "BertForMaskedLM",
        ENCODER,
        "tokens",
    ),
    "deberta-v2": (
        "DebertaV2Config",
        "DebertaV2ForMaskedLM",
        ENCODER,
        "tokens",
    ),
    "swinv2": (
        "Swinv2Config",
        "Swinv2ForImageClassification",
        {
            "image_size": 16,
            "patch_size": 2,
            "embed_dim": 16,
            "depths": [1, 1],
            "num_heads": [2, 2],
            "window_size": 4,
            "num_labels": 3,
            "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0,
            "drop_path_rate": 0.0,
        },
        "images",
    ),
    "vit": (
        "ViTConfig",
        "ViTForImageClassification",
        {
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "intermediate_size": 64,
            "image_size": 16,
            "patch_size": 4,
            "num_labels": 3,
            "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0,
        },
        "images",
    ),
}


def _tiny_hf(name: str):
    import transformers

    config_class, model_class, config, _ = TINY_HF[name]
    return getattr(transformers, model_class)(getattr(transformers, config_class)(**config))


def _batch(name: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if TINY_HF[name][3] == "images":
        return {
            "pixel_values": torch.randn(2, 3, 16, 16, generator=g),
            "labels": torch.tensor([0, 2]),
        }
    ids = torch.randint(0, 128, (2, 12), generator=g)
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("name", sorted(TINY_HF))
def test_other_tiny_hf_models_forward_backward(name):
    """GPT-2 (GELU-tanh, Conv1D projections), BERT and ViT (a patch convolution, erf GELU),
    DeBERTa-v2 (a 0-d attention scale), Swin v2 (cosine attention: F.normalize's expanded
    divisor saved for backward), each with LayerNorm kept whole, and T5 (its own RMSNorm, ReLU
    MLP, relative position bias, encoder-decoder) train under ``backend="dvm"``: the loss and
    every gradient equal eager, every graph compiled and its regions run on the VM."""
    torch.manual_seed(0)
    model = _tiny_hf(name).train()
    batch = _batch(name)
    out = model(**batch)
    out.loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    compiled, graphs = _compile(model)
    got = compiled(**batch)
    got.loss.backward()
    torch.testing.assert_close(got.loss.detach(), out.loss.detach(), atol=1e-5, rtol=1e-5)
    scale = max(g.abs().max().item() for g in want.values())
    for n, p in model.named_parameters():
        if n in want:
            torch.testing.assert_close(p.grad, want[n], atol=1e-5 * scale, rtol=1e-4, msg=n)
    regions = sum(len(c.regions) for _, c in graphs)
    failed = [w for _, c in graphs for w in c.clustering.notes if "could not compile" in w]
    assert not failed
    assert {kind for kind, _ in graphs} == {"forward", "backward"}
    assert regions >= 2, [(kind, c.fallbacks) for kind, c in graphs]
    assert sum(c.vm_calls for _, c in graphs) == regions
    assert all(c.eager_calls == 0 for _, c in graphs)
    whole = {n.target for _, c in graphs for n, why in c.fallbacks if why in KEPT_WHOLE.values()}
    norms = {aten.native_layer_norm.default, aten.native_layer_norm_backward.default}
    assert whole == (set() if name == "t5" else norms)
