"""``amp_graph.plan_fsdp``: each FSDP2 unit's ``MixedPrecisionPolicy`` from the AMP plan,
decided before sharding (issue 24, "FSDP2 should all-gather parameters in the low dtype
where the policy permits"). One process: planning needs no process group. That a model
sharded by the plan trains the same bits at half the all-gather is
``tests/test_fsdp2_amp.py``'s (2 gloo ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from hf_configs import small_llama_config

import amp_graph
from amp_graph.demo.models import GPT, LlamaStyle, ResidualMLP
from amp_graph.training.fsdp_plan import FSDPPlan, plan_fsdp

BF16 = torch.bfloat16


def _low(plan: FSDPPlan, unit: nn.Module | str) -> bool:
    policy = plan[unit]
    if policy.param_dtype is None:
        assert policy == type(policy)(), policy  # float32 units keep FSDP2's default
        return False
    assert policy.reduce_dtype == torch.float32 and not policy.cast_forward_inputs
    assert policy.output_dtype is None
    return policy.param_dtype == plan.dtype


def test_units_read_only_through_low_casts_gather_low_and_the_rest_float32() -> None:
    torch.manual_seed(0)
    model = ResidualMLP(width=32, blocks=3)
    plan = plan_fsdp(model, [*model.blocks, model], "O1", example_inputs=(torch.randn(4, 32),))
    assert plan.dtype == BF16
    assert all(_low(plan, block) for block in model.blocks)
    assert not _low(plan, model)  # the root owns no parameter: nothing to gather low
    assert plan.all_gather_ratio == 0.5
    block = plan.units["blocks.0"]
    assert block.parameters == 4 and block.gathered_bytes * 2 == block.full_bytes
    assert "all-gather 0.50x float32" in str(plan) and "blocks.2: 4 parameters" in str(plan)
    # fp16 plans fp16
    half = plan_fsdp(model, [model], "O1", torch.float16, example_inputs=(torch.randn(4, 32),))
    assert half[""].param_dtype == torch.float16


def test_a_unit_mixing_norms_and_linears_stays_float32_and_names_what_to_split() -> None:
    """FSDP2's policy is per unit: a Llama layer's RMSNorm weights are read in float32
    under O1, so the layer gathers float32 (exact), and the plan names the children that
    would gather low as units of their own; planned again with them, they do."""
    torch.manual_seed(0)
    model = LlamaStyle(dim=64, blocks=2)
    x = torch.randn(2, 16, 64)
    plan = plan_fsdp(model, [*model.blocks, model], "O1", example_inputs=(x,))
    for i in range(2):
        assert not _low(plan, f"blocks.{i}")
        assert plan.units[f"blocks.{i}"].read_exact == ["norm.weight", "mlp.norm.weight"]
        assert plan.split[f"blocks.{i}"] == [
            f"blocks.{i}.attn",
            f"blocks.{i}.mlp.gate",
            f"blocks.{i}.mlp.up",
            f"blocks.{i}.mlp.down",
        ]
    assert plan.all_gather_ratio == 1.0
    assert "read in float32: norm.weight, mlp.norm.weight" in str(plan)
    split = [model.get_submodule(path) for paths in plan.split.values() for path in paths]
    replanned = plan_fsdp(model, [*model.blocks, model, *split], "O1", example_inputs=(x,))
    assert all(_low(replanned, unit) for unit in split)
    assert not _low(replanned, model.blocks[0]) and replanned.split == {}
    assert replanned.units["blocks.0"].parameters == 2  # only the norms are left to it
    assert replanned.all_gather_ratio <= 0.55
    # split_mixed=True: the same plan from one capture
    units = [*model.blocks, model]
    at_once = plan_fsdp(model, units, "O1", example_inputs=(x,), split_mixed=True)
    assert at_once.units == replanned.units and at_once.split == {}


def test_a_tied_weight_read_in_float32_anywhere_is_never_gathered_low() -> None:
    """GPT's head is tied to the token embedding: the head reads it through a bf16 cast,
    the embedding reads it in float32. Whichever name the graph reads it by, it stays
    float32."""
    torch.manual_seed(0)
    model = GPT(vocab=64, block=16, dim=32, heads=4, layers=2)
    ids = torch.randint(0, 64, (2, 16))
    plan = plan_fsdp(model, [*model.blocks, model], "O1", example_inputs=(ids,))
    assert not _low(plan, model)
    assert "tok.weight" in plan.units[""].read_exact
    assert all(_low(plan, block) is False for block in model.blocks)  # LayerNorms
    # FSDP2 would shard the head's and the root's alias separately: refused
    with pytest.raises(ValueError, match=r"tied parameters 'tok\.weight' and 'head\.weight'"):
        plan_fsdp(model, [*model.blocks, model.head, model], "O1", example_inputs=(ids,))


class TiedPair(nn.Module):
    """Two linears sharing one weight (read low by both), beside a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(self.norm(x)))


def test_a_split_never_separates_tied_parameters() -> None:
    """The unit is mixed (the norm) and both linears are read only low, but they share a
    weight: either alone as a unit would untie it, so neither is offered; untied, both are."""
    x = (torch.randn(2, 8),)
    model = TiedPair()
    plan = plan_fsdp(model, [model], "O1", example_inputs=x, split_mixed=True)
    assert list(plan.units) == [""] and plan.split == {} and not _low(plan, "")
    untied = TiedPair()
    untied.b.weight = nn.Parameter(untied.a.weight.detach().clone())
    plan = plan_fsdp(untied, [untied], "O1", example_inputs=x)
    assert plan.split == {"": ["a", "b"]}


def test_what_the_policy_keeps_exact_keeps_the_unit_float32() -> None:
    torch.manual_seed(0)
    model = ResidualMLP(width=32, blocks=2)
    x = (torch.randn(4, 32),)
    units = [*model.blocks, model]
    pinned = amp_graph.Policy.preset("O1").override(modules={"blocks.1.*": "deny"})
    plan = plan_fsdp(model, units, pinned, example_inputs=x)
    assert _low(plan, "blocks.0") and not _low(plan, "blocks.1")
    assert plan.units["blocks.1"].read_exact == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert not any(_low(plan_fsdp(model, units, "O0", example_inputs=x), u) for u in units)
    # fp8 quantizes the float32 weight (its scale is the float32 amax): not a bf16 cast
    fp8 = plan_fsdp(model, units, "fp8", example_inputs=x)
    assert not any(_low(fp8, u) for u in units)


def test_hf_llama_layers_gather_float32_and_their_attention_and_mlp_low() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(small_llama_config())
    ids = torch.randint(0, 100, (2, 16))
    layers = list(model.model.layers)
    plan = plan_fsdp(model, [*layers, model], "O1", example_inputs=(ids,))
    assert plan.split["model.layers.0"] == ["model.layers.0.self_attn", "model.layers.0.mlp"]
    assert plan.split[""] == ["lm_head"]  # the embedding and the final norm read float32
    units = [*layers, model, *(model.get_submodule(p) for s in plan.split.values() for p in s)]
    replanned = plan_fsdp(model, units, "O1", example_inputs=(ids,))
    assert all(_low(replanned, layer.self_attn) and _low(replanned, layer.mlp) for layer in layers)
    assert _low(replanned, model.lm_head) and not _low(replanned, model)


def test_mistakes_get_errors_that_say_what_to_do() -> None:
    model = ResidualMLP(width=8, blocks=1)
    x = (torch.randn(2, 8),)
    with pytest.raises(ValueError, match="not a submodule of the model"):
        plan_fsdp(model, [nn.Linear(2, 2)], example_inputs=x)
    with pytest.raises(ValueError, match=r"no submodule 'blocks\.7'"):
        plan_fsdp(model, ["blocks.7"], example_inputs=x)
    with pytest.raises(TypeError, match="units are modules or their paths; got int"):
        plan_fsdp(model, [3], example_inputs=x)
    with pytest.raises(ValueError, match="no units given"):
        plan_fsdp(model, [], example_inputs=x)
    with pytest.raises(ValueError, match="policy"):
        plan_fsdp(model, [model], "O7", example_inputs=x)
    plan = plan_fsdp(model, [model], example_inputs=x)
    with pytest.raises(KeyError, match="not a unit of this plan"):
        plan[model.blocks[0]]
    with pytest.raises(ValueError, match="sets each unit's mp_policy from the plan"):
        plan.fully_shard(mp_policy=None)


def test_a_model_built_on_the_meta_device_is_planned_as_the_materialized_one() -> None:
    """FSDP2's recipe for a model larger than a rank's memory builds it on the meta device
    and shards it before materializing it: the plan is made then, on fake tensors (meta
    tensors have no autocast, which SDPA's dtype check relies on), allocating nothing."""
    transformers = pytest.importorskip("transformers")
    config = small_llama_config()
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(config)
    real = transformers.LlamaForCausalLM(config)
    ids = torch.zeros(2, 16, dtype=torch.long)
    plans = [
        plan_fsdp(m, [*m.model.layers, m], "O1", example_inputs=(x,))
        for m, x in ((meta, ids.to("meta")), (real, ids))
    ]
    assert plans[0].units == plans[1].units and plans[0].split == plans[1].split
    assert plans[0].split["model.layers.0"] == ["model.layers.0.self_attn", "model.layers.0.mlp"]
    assert all(p.is_meta for p in meta.parameters())  # the user's model is left as it was
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device='cuda'\) plans under CUDA's autocast"):
            plan_fsdp(meta, [meta], example_inputs=(ids,), device="cuda")
    with pytest.raises(ValueError, match="device= is for a model on the meta device"):
        plan_fsdp(real, [real], example_inputs=(ids,), device="cpu")
