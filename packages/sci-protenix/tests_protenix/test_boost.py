"""``sci_protenix.boost`` on Protenix 2.0.0 modules: boosted equals un-boosted on the same inputs
(a deep copy kept as the oracle), the modules are sci-protenix's, the parameters are the model's
own tensors, a plan chunks and still equals, errors name the module. fp32, eval unless stated;
tolerance rtol 1e-5, atol 1e-5 (the same sums in another order)."""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from sci_protenix.boosting import BoostError, boost
from sci_protenix.memory_plan import MemoryPlan

TOL = {"rtol": 1e-5, "atol": 1e-5}
PLAN = MemoryPlan(tri_mul=2, tri_att=3, transition=2, pair_bias=2, outer_product=2, msa=2)
N, C_Z, C_S, C_M, C_S_INPUTS = 7, 8, 6, 8, 10
Randomize = Callable[..., nn.Module]


def assert_grads_close(got: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...]) -> None:
    """Gradients equal to 1e-5 of each tensor's largest entry, or 1e-6 of the largest gradient
    of all (for gradients that are zero in exact arithmetic): backward sums over N² pairs and
    heads, and the two implementations order those sums differently."""
    scale = max(e.abs().max().item() for e in expected)
    for g, e in zip(got, expected, strict=True):
        atol = max(1e-5 * e.abs().max().item(), 1e-6 * scale)
        torch.testing.assert_close(g, e, rtol=1e-5, atol=atol)


def protenix_modules(model: nn.Module) -> list[str]:
    """Names of the Protenix Pairformer/MSA-kind modules left in ``model``."""
    kinds = ("Pairformer", "MSA", "Triangle", "OuterProduct", "AttentionPairBias")
    return [
        name
        for name, m in model.named_modules()
        if type(m).__module__.startswith("protenix.") and type(m).__name__.startswith(kinds)
    ]


def stack(px: SimpleNamespace, n_blocks: int = 2, **kwargs: Any) -> nn.Module:
    kwargs = {"n_heads": 2, "c_z": C_Z, "c_s": C_S, "dropout": 0.0} | kwargs
    return px.pairformer.PairformerStack(n_blocks=n_blocks, **kwargs)


def pair_inputs(
    masked: bool, c_z: int = C_Z
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    s, z = torch.randn(N, C_S), torch.randn(N, N, c_z)
    mask = None
    if masked:  # some pairs masked, no row fully masked (Protenix's -1e9 bias and an exact
        mask = (torch.rand(N, N) > 0.3).float()  # mask differ only there)
        mask[:, 0] = mask[0, :] = 1.0
    return s, z, mask


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("chunk_size", [None, 3])
def test_pairformer_stack(
    px: SimpleNamespace, randomize: Randomize, masked: bool, chunk_size: int | None
) -> None:
    model = randomize(stack(px)).eval()
    reference = copy.deepcopy(model)
    params = dict(model.named_parameters())
    boosted = boost(model)
    assert type(boosted).__module__ == "sci_protenix.pairformer"
    assert protenix_modules(boosted) == []
    assert [r.path for r in boosted.boost_report] == [""]
    assert all(p is params[name] for name, p in boosted.named_parameters())
    s, z, mask = pair_inputs(masked)
    with torch.no_grad():
        expected = reference(s, z, mask, chunk_size=chunk_size)
        got = boosted(s, z, mask, chunk_size=chunk_size)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, **TOL)


def test_pairformer_stack_with_a_plan(px: SimpleNamespace, randomize: Randomize) -> None:
    model = randomize(stack(px, c_z=32, hidden_scale_up=True)).eval()  # 1 head of 32, c_mul 32
    reference = copy.deepcopy(model)
    boosted = boost(model, plan=PLAN)
    assert all(m.plan is PLAN for m in boosted.modules() if hasattr(m, "plan"))
    calls = []
    tri_mul = boosted.blocks[0].tri_mul_out
    tri_mul.linear_z.register_forward_hook(lambda *_: calls.append(1))
    s, z, mask = pair_inputs(masked=True, c_z=32)
    with torch.no_grad():
        expected = reference(s, z, mask)
        got = boosted(s, z, mask)
    assert len(calls) > 1  # the plan's tri_mul chunks ran
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, **TOL)


def test_pairformer_stack_training_gradients(px: SimpleNamespace, randomize: Randomize) -> None:
    """Training mode without dropout, Protenix's per-block checkpoints vs the boosted stack's."""
    model = randomize(stack(px, blocks_per_ckpt=1)).train()
    reference = copy.deepcopy(model)
    boosted = boost(model)
    s0, z0, mask = pair_inputs(masked=True)
    results = []
    for module in (reference, boosted):
        s, z = s0.clone().requires_grad_(), z0.clone().requires_grad_()
        s_out, z_out = module(s, z, mask)
        loss = s_out.square().sum() + z_out.square().sum()
        results.append(torch.autograd.grad(loss, [s, z, *module.parameters()]))
    assert_grads_close(results[1], results[0])


def msa_features(rows: int = 9) -> dict[str, torch.Tensor]:
    return {
        "msa": torch.randint(0, 32, (rows, N)),
        "has_deletion": (torch.rand(rows, N) > 0.7).float(),
        "deletion_value": torch.rand(rows, N),
    }


MSA_CONFIGS = {"sample_cutoff": {"train": 6, "test": 7}, "min_size": {"train": 2, "test": 3}}


class Trunk(nn.Module):
    """Protenix's trunk in small: MSA module, Pairformer stack, and a transition that is not the
    Pairformer's (as the diffusion module's), which boost must leave alone."""

    def __init__(self, px: SimpleNamespace) -> None:
        super().__init__()
        self.msa_module = px.pairformer.MSAModule(
            n_blocks=2,
            c_m=C_M,
            c_z=C_Z,
            c_s_inputs=C_S_INPUTS,
            msa_dropout=0.0,
            pair_dropout=0.0,
            msa_chunk_size=4,
            msa_max_size=16,
            msa_configs=MSA_CONFIGS,
        )
        self.pairformer_stack = stack(px)
        self.transition_z1 = px.primitives.Transition(c_in=C_Z, n=2)

    def forward(
        self,
        feats: dict[str, torch.Tensor],
        z: torch.Tensor,
        s_inputs: torch.Tensor,
        s: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.msa_module(feats, z, s_inputs, pair_mask=None)
        s, z = self.pairformer_stack(s, z, pair_mask=None)
        return s, z + self.transition_z1(z)


@pytest.mark.parametrize("plan", [None, PLAN])
def test_trunk_with_msa_module(
    px: SimpleNamespace, randomize: Randomize, plan: MemoryPlan | None
) -> None:
    model = randomize(Trunk(px)).eval()
    reference = copy.deepcopy(model)
    boosted = boost(model, plan=plan)
    assert boosted is model
    assert {r.path for r in model.boost_report} == {"msa_module", "pairformer_stack"}
    assert protenix_modules(model) == []
    assert type(model.transition_z1).__module__ == "protenix.model.modules.primitives"
    assert model.msa_module.msa_configs == reference.msa_module.msa_configs
    feats, z, s_inputs, s = (
        msa_features(),
        torch.randn(N, N, C_Z),
        torch.randn(N, C_S_INPUTS),
        torch.randn(N, C_S),
    )
    with torch.no_grad():
        torch.manual_seed(5)  # the same MSA rows sampled by both
        expected = reference(feats, z, s_inputs, s)
        torch.manual_seed(5)
        got = model(feats, z, s_inputs, s)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, **TOL)


def test_msa_module_training_gradients(px: SimpleNamespace, randomize: Randomize) -> None:
    model = randomize(Trunk(px)).msa_module.train()
    reference = copy.deepcopy(model)
    boost(model.blocks)  # a ModuleList: its MSABlocks are swapped inside the Protenix MSAModule
    feats, s_inputs = msa_features(), torch.randn(N, C_S_INPUTS)
    results = []
    for module in (reference, model):
        z = torch.randn(N, N, C_Z, generator=torch.Generator().manual_seed(1)).requires_grad_()
        torch.manual_seed(7)
        out = module(feats, z, s_inputs, pair_mask=None)
        results.append(torch.autograd.grad(out.square().sum(), [z, *module.parameters()]))
    assert protenix_modules(model.blocks) == []
    assert_grads_close(results[1], results[0])


def test_template_embedder(px: SimpleNamespace, randomize: Randomize) -> None:
    """The template embedder's c_s = 0 Pairformer stack (called with s=None) swapped inside it."""
    model = randomize(px.pairformer.TemplateEmbedder(n_blocks=2, c=8, c_z=C_Z, dropout=0.0))
    model.eval()
    reference = copy.deepcopy(model)
    boost(model, plan=MemoryPlan(tri_mul=3, tri_att=2))
    assert [r.path for r in model.boost_report] == ["pairformer_stack"]
    t = 2
    feats = {
        "asym_id": torch.tensor([0, 0, 0, 0, 1, 1, 1]),
        "template_aatype": torch.randint(0, 32, (t, N)),
        "template_distogram": torch.rand(t, N, N, 39),
        "template_pseudo_beta_mask": (torch.rand(t, N, N) > 0.2).float(),
        "template_unit_vector": torch.randn(t, N, N, 3),
        "template_backbone_frame_mask": (torch.rand(t, N, N) > 0.2).float(),
    }
    z = torch.randn(N, N, C_Z)
    with torch.no_grad():
        expected = reference(feats, z)
        got = model(feats, z)
    assert expected.abs().max() > 1e-2
    torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.parametrize(
    ("cls", "args"),
    [
        ("triangular.TriangleMultiplicationOutgoing", (C_Z, 4)),
        ("triangular.TriangleMultiplicationIncoming", (C_Z, 4)),
        ("triangular.TriangleAttention", (C_Z, 4, 2)),
        ("triangular.TriangleAttentionEndingNode", (C_Z, 4, 2)),
        ("layers.OuterProductMean", (C_M, C_Z, 3)),
    ],
)
def test_single_modules(px: SimpleNamespace, randomize: Randomize, cls: str, args: tuple) -> None:
    module_name, name = cls.split(".")
    model = randomize(getattr(getattr(px, module_name), name)(*args)).eval()
    reference = copy.deepcopy(model)
    boosted = boost(model)
    assert type(boosted).__module__.startswith("sci_protenix.")
    x = torch.randn(5, N, C_M) if name == "OuterProductMean" else torch.randn(N, N, C_Z)
    with torch.no_grad():
        torch.testing.assert_close(boosted(x), reference(x), **TOL)


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        ("TriangleMultiplicationOutgoing", {"_outgoing": False}),
        ("TriangleMultiplicationIncoming", {"_outgoing": True}),
        ("TriangleAttentionEndingNode", {"starting": True}),
    ],
)
def test_a_module_built_against_its_class_name_keeps_its_direction(
    px: SimpleNamespace, randomize: Randomize, cls: str, kwargs: dict[str, bool]
) -> None:
    """Protenix's classes take ``_outgoing``/``starting`` against their names (partialmethod)."""
    args = (C_Z, 4) if cls.startswith("TriangleMultiplication") else (C_Z, 4, 2)
    model = randomize(getattr(px.triangular, cls)(*args, **kwargs)).eval()
    reference = copy.deepcopy(model)
    boosted = boost(model)
    x = torch.randn(N, N, C_Z)
    with torch.no_grad():
        torch.testing.assert_close(boosted(x), reference(x), **TOL)


def test_frozen_parameters_stay_frozen(px: SimpleNamespace) -> None:
    model = stack(px, n_blocks=1)
    model.blocks[0].tri_att_start.requires_grad_(False)
    boosted = boost(model)
    frozen = {n for n, p in boosted.named_parameters() if not p.requires_grad}
    assert frozen == {
        f"blocks.0.tri_att_start.{n}" for n, _ in model.blocks[0].tri_att_start.named_parameters()
    }


def test_each_submodule_keeps_its_train_or_eval_mode(px: SimpleNamespace) -> None:
    """A stack in training with its last block in eval came back all in training: the swap
    set every submodule to the stack's own mode."""
    model = stack(px).train()
    model.blocks[1].eval()
    before = {name: m.training for name, m in model.named_modules()}
    boosted = boost(model)
    after = {name: m.training for name, m in boosted.named_modules()}
    assert after["blocks.1"] is False
    assert after["blocks.0"] is True
    shared = before.keys() & after.keys()  # Protenix has modules ours does not, and back
    assert {name: after[name] for name in shared} == {name: before[name] for name in shared}
    assert not any(mode for name, mode in after.items() if name.startswith("blocks.1."))


def test_boosting_twice_changes_only_the_plan(px: SimpleNamespace) -> None:
    model = nn.Sequential(stack(px, n_blocks=1))
    boost(model)
    swapped = model[0]
    boost(model, plan=PLAN)
    assert model[0] is swapped
    assert [r.path for r in model.boost_report] == ["0"]
    assert model[0].blocks[0].tri_mul_out.plan is PLAN


def test_unexpected_shape_names_the_module_and_swaps_nothing(px: SimpleNamespace) -> None:
    model = nn.Sequential(stack(px, n_blocks=1), stack(px, n_blocks=2))
    model[1].blocks[1].tri_mul_in.linear_z = nn.Linear(4, C_Z + 1, bias=False)
    model[1].requires_grad_(False)
    with pytest.raises(
        BoostError, match=r"(?s)cannot swap 1 \(PairformerStack\).*blocks\.1\.tri_mul_in\.linear_z"
    ):
        boost(model)
    assert len(protenix_modules(model[0])) > 0  # the stack that did fit was not swapped either
    assert not any(p.requires_grad for p in model[1].parameters())


def test_unsupported_configuration_is_an_error(px: SimpleNamespace) -> None:
    block = px.pairformer.PairformerBlock(n_heads=2, c_z=C_Z, c_s=C_S)
    block.attention_pair_bias.has_s = True
    with pytest.raises(BoostError, match="attention_pair_bias is not the Pairformer's"):
        boost(nn.ModuleList([block]))


def test_nothing_to_boost_and_bad_arguments(
    px: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(BoostError, match="no Protenix Pairformer/MSA module found in Linear"):
        boost(nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"boost needs a torch\.nn\.Module"):
        boost("model")
    with pytest.raises(TypeError, match=r"plan must be a sci_protenix\.MemoryPlan"):
        boost(stack(px, n_blocks=1), plan={"tri_mul": 2})
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "protenix" else real(name, *a)
    )
    with pytest.raises(
        ImportError, match=r"protenix is not installed: pip install protenix==2\.0\.0"
    ):
        boost(stack(px, n_blocks=1))
