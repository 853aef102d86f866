"""assign_dtypes reuses the capture's values: the same plan as running every node.

The capture computes each node's fake value under the policy (amp_graph.capture.planned_dtypes) and
records the decision it computed it under (``meta[CAPTURE_PLAN]``). assign_dtypes takes that
value wherever it decides the same, and runs the node on fake inputs only where the plan
changed its inputs (issue 20, "fast passes"). These tests hold:

* reuse changes nothing: with the records and without them (every node run on fake values),
  each node gets the same compute dtype, output dtype, and a value of the same dtype and
  shape, on the front-end zoo, the models of ``amp_graph.demo.models`` (BatchNorm among
  them), small HF models, a diffusers UNet, a Mixtral mixture of experts and every op
  sample of the O1 per-op tests, under every preset and both low dtypes (the UNet and the
  MoE also match CPU autocast bit for bit under ``policy="autocast"``);
* reuse is real: on a GPT, under every preset, nearly every op carries a record and no op
  runs on fake values (the cost the benchmark measures, benchmarks/pass_bench.py), though
  O2 and O3 read float32 parameters the capture saw in the low dtype (their casts read
  them alike);
* where the capture computed a value unlike the rewritten graph (an inner kernel widened,
  as in ``batch_norm`` of a bf16 input with float32 weights), nothing is recorded.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from amp_graph.passes import AMP, inline_regions
from amp_graph.passes.assign_dtypes import assign_dtypes
from amp_graph.passes.classify import classify
from amp_graph.passes.meta import CAPTURE_PLAN, VAL
from test_front_end import MODELS

import amp_graph
from amp_graph.capture import capture_module
from amp_graph.demo import models
from amp_graph.frontends.policy_request import resolve_policy

BF16, FP16 = torch.bfloat16, torch.float16


def _planned(model: nn.Module, inputs: tuple, policy: str, dtype: torch.dtype, reuse: bool):
    """A fresh capture of ``model`` through classify and assign_dtypes; ``reuse=False`` drops
    the capture's records first, so that every node runs on fake values."""
    resolved = resolve_policy(policy, "cpu")
    gm = capture_module(
        model,
        inputs,
        {},
        device_type="cpu",
        autocast_dtype=None if resolved.casts_nothing else dtype,
        policy=resolved,
        low_dtype=dtype,
    ).graph_module
    inline_regions(gm)
    records = sum(CAPTURE_PLAN in n.meta for n in gm.graph.nodes)
    if not reuse:
        for node in gm.graph.nodes:
            node.meta.pop(CAPTURE_PLAN, None)
    classify(gm, resolved)
    assign_dtypes(gm, dtype, resolved.cast_inputs)
    return gm, records


def _describe(value):
    # Not the strides: a fake value's strides follow the kernel that computed it (the capture
    # saw scaled_dot_product_attention's CPU kernel, a fake run its meta function), and no
    # pass reads them.
    if isinstance(value, torch.Tensor):
        return (value.dtype, tuple(value.shape))
    if isinstance(value, (tuple, list)):
        return tuple(_describe(v) for v in value)
    return type(value).__name__


def _plan_of(gm) -> dict[str, tuple]:
    return {
        node.name: (
            node.meta[AMP].compute_dtype,
            node.meta[AMP].out_dtype,
            _describe(node.meta.get(VAL)),
        )
        for node in gm.graph.nodes
    }


def _assert_reuse_changes_nothing(make_model, make_inputs, policy, dtype) -> None:
    torch.manual_seed(0)
    model, inputs = make_model(), make_inputs()
    reused, records = _planned(model, inputs, policy, dtype, reuse=True)
    full, _ = _planned(model, inputs, policy, dtype, reuse=False)
    assert records > 0, "the capture recorded no plan: the comparison would be vacuous"
    ours, theirs = _plan_of(reused), _plan_of(full)
    assert ours.keys() == theirs.keys()
    differing = {name: (ours[name], theirs[name]) for name in ours if ours[name] != theirs[name]}
    assert differing == {}


@pytest.mark.parametrize("policy", ["O1", "O2", "O3", "autocast"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_reuse_changes_nothing_on_the_zoo(name: str, policy: str) -> None:
    make_model, make_inputs, _ = MODELS[name]
    _assert_reuse_changes_nothing(make_model, make_inputs, policy, BF16)


def _tokens() -> tuple[torch.Tensor]:
    return (torch.randint(0, 64, (2, 16)),)


SHIPPED = {
    "ConvNet": (models.ConvNet, lambda: (torch.randn(2, 1, 8, 8),)),
    "GPT": (models.GPT, _tokens),
    "LlamaMLP": (models.LlamaMLP, lambda: (torch.randn(2, 32),)),
    "MixedOpsNet": (models.MixedOpsNet, lambda: (torch.randn(4, 16),)),
}


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("policy", ["O1", "O2", "O3"])
@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_reuse_changes_nothing_on_the_shipped_models(name: str, policy: str, dtype) -> None:
    make_model, make_inputs = SHIPPED[name]
    _assert_reuse_changes_nothing(make_model, make_inputs, policy, dtype)


@pytest.mark.parametrize("policy", ["O1", "O2"])
@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "t5"])
def test_reuse_changes_nothing_on_hf_models(name: str, policy: str) -> None:
    pytest.importorskip("transformers")
    from test_capture_policy import Logits, _hf, _ids

    _assert_reuse_changes_nothing(lambda: Logits(_hf(name)), lambda: (_ids(),), policy, FP16)


@pytest.mark.parametrize("policy", ["O1", "O2", "O3", "autocast"])
def test_a_gpt_runs_no_op_on_fake_values(monkeypatch, policy: str) -> None:
    from amp_graph.passes.assign_dtypes import _Planner

    runs: list[str] = []
    original = _Planner.call_function

    def counted(self, target, args, kwargs):
        runs.append(str(target))
        return original(self, target, args, kwargs)

    monkeypatch.setattr(_Planner, "call_function", counted)
    torch.manual_seed(0)
    gm, records = _planned(models.GPT(layers=3), _tokens(), policy, BF16, reuse=True)
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert records >= 0.9 * len(ops)
    assert runs == []
    # the same graph without the records runs every op that is not a view or a pointwise op
    runs.clear()
    _planned(models.GPT(layers=3), _tokens(), policy, BF16, reuse=False)
    assert len(runs) > 0.25 * len(ops)


def test_a_value_the_capture_widened_is_not_recorded() -> None:
    """Captured under O1, ``batch_norm`` of the conv's bf16 output with float32 weights had
    its inner kernel's inputs widened: its value is float32, the rewritten graph's bf16."""
    torch.manual_seed(0)
    gm, _ = _planned(models.ConvNet(), (torch.randn(2, 1, 8, 8),), "O1", BF16, reuse=True)
    norms = [n for n in gm.graph.nodes if "batch_norm" in str(n.target)]
    assert norms
    for node in norms:
        assert CAPTURE_PLAN not in node.meta
        assert node.meta[AMP].out_dtype == BF16
    compiled = amp_graph.compile(models.ConvNet(), "O1", BF16)
    out = compiled(torch.randn(2, 1, 8, 8))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("low", [FP16, BF16], ids=["fp16", "bf16"])
def test_reuse_changes_nothing_op_by_op(low: torch.dtype) -> None:
    """Every op sample of the O1 per-op tests (each of torch.autocast's listed ops, at the
    inputs that make each list decide), captured and planned with the records and without."""
    import torch.fx as fx
    from op_samples import SAMPLES
    from test_o1_per_op import CATEGORIES, cases

    from amp_graph.frontends.compiler import graph_code_module

    differing: dict[str, tuple] = {}
    compared = 0
    for name, sample in sorted(SAMPLES.items()):
        if sample.aten not in CATEGORIES:
            continue  # an op this torch's autocast lists do not name (rms_norm before 2.13)
        traced = fx.symbolic_trace(sample.fn)
        for case in cases(sample, low):
            try:
                reused, _ = _planned(graph_code_module(traced), case.inputs, "O1", low, True)
            except amp_graph.CaptureError:
                continue  # CPU cannot run it at these dtypes (test_o1_per_op says which)
            full, _ = _planned(graph_code_module(traced), case.inputs, "O1", low, False)
            compared += 1
            ours, theirs = _plan_of(reused), _plan_of(full)
            if ours != theirs:
                differing[f"{name} ({case.label})"] = (ours, theirs)
    assert compared > 100
    assert differing == {}


@pytest.mark.parametrize("policy", ["O1", "O2", "autocast"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_simplify_casts_reaches_its_fixpoint_in_one_walk(name: str, policy: str) -> None:
    """simplify_casts walks the graph once: run again on its result, it finds nothing."""
    from amp_graph.passes.simplify_casts import simplify_casts

    make_model, make_inputs, _ = MODELS[name]
    torch.manual_seed(0)
    compiled = amp_graph.compile(make_model(), policy, BF16, example_inputs=make_inputs())
    gm = amp_graph.frontends.compiler.as_graph_module(compiled)
    nodes = [n.format_node() for n in gm.graph.nodes]
    assert simplify_casts(gm).stats["casts_removed"] == 0
    assert [n.format_node() for n in gm.graph.nodes] == nodes


# --- model code beyond transformers' dense decoders: a diffusers UNet, an MoE ---------------


class _UNet(nn.Module):
    """A diffusers UNet2DModel from a small random config (ResNet blocks, GroupNorm,
    attention blocks, timestep embeddings), returning the sample."""

    def __init__(self) -> None:
        super().__init__()
        diffusers = pytest.importorskip("diffusers")
        self.unet = diffusers.UNet2DModel(
            sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
            block_out_channels=(32, 64), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8,
        ).eval()  # fmt: skip

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        return self.unet(sample, timestep).sample


class _MoE(nn.Module):
    """transformers' Mixtral (sparse mixture of experts: top-2 routing of 4 experts, a
    data-dependent gather and scatter of tokens), random small config, returning logits."""

    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        config = transformers.MixtralConfig(
            vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2, max_position_embeddings=64, use_cache=False,
        )  # fmt: skip
        self.model = transformers.MixtralForCausalLM(config).eval()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits


BEYOND = {
    "unet": (_UNet, lambda: (torch.randn(2, 3, 8, 8), torch.tensor([10, 20]))),
    "moe": (_MoE, lambda: (torch.randint(0, 100, (2, 12)),)),
}


@pytest.mark.parametrize("policy", ["O1", "O2"])
@pytest.mark.parametrize("name", sorted(BEYOND))
def test_reuse_changes_nothing_on_a_unet_and_an_moe(name: str, policy: str) -> None:
    make_model, make_inputs = BEYOND[name]
    _assert_reuse_changes_nothing(make_model, make_inputs, policy, BF16)


@pytest.mark.parametrize("name", sorted(BEYOND))
def test_a_unet_and_an_moe_under_policy_autocast_are_cpu_autocast(name: str) -> None:
    from oracles import assert_bitwise_cpu_autocast

    make_model, make_inputs = BEYOND[name]
    torch.manual_seed(0)
    assert_bitwise_cpu_autocast(make_model(), make_inputs())


@pytest.mark.parametrize("op", ["_softmax", "_log_softmax"])
@pytest.mark.parametrize(
    ("compute", "expected"),
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_cuda_half_to_float_softmax_takes_the_planned_input(op, compute, expected) -> None:
    """CUDA autocast runs ``softmax(x16, dtype=float32)`` as ``_softmax(x16, dim, True)``,
    which takes only a 16-bit input. Where the capture's plan casts that input, the kernel
    becomes the plain one (a real GPU capture of an fp16 softmax under O1 failed on it);
    where it leaves it, the kernel is left as it was. On fake CUDA tensors: no GPU needed."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from amp_graph.capture.planned_dtypes import _adjusted, _Plan

    func = getattr(torch.ops.aten, op).default
    with FakeTensorMode():
        x = torch.empty(4, 8, dtype=torch.float16, device="cuda")
        plan = _Plan(None, compute, [], func, ())
        args, kwargs = _adjusted(func, (x, -1, True), {}, plan)
        out = func(*args, **kwargs)
    assert out.dtype == expected and out.device.type == "cuda"
    assert args[2] is (compute == torch.float16)


def test_the_planning_modes_flat_scan_finds_pytrees_tensor_leaves() -> None:
    """The capture's planning mode finds a kernel's tensor arguments with a flat scan (no
    pytree walk per kernel); their positions must be pytree's leaf positions, which the cast
    path indexes, and any deeper structure falls back to pytree."""
    from torch.utils import _pytree as pytree

    from amp_graph.capture.planned_dtypes import _flat_tensors

    a, b, c = torch.ones(2), torch.ones(3, dtype=torch.bfloat16), torch.ones(1)
    calls = [
        ((a, b), {}),
        ((a, 2, [b, None, c], -1), {}),
        ((a, (), [b]), {"weight": c, "eps": 1e-5, "out": None}),
        ((None, [None, a], 3.0), {"dtype": torch.float32}),
    ]
    for args, kwargs in calls:
        leaves = pytree.tree_leaves((args, kwargs))
        expected = {i: v for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)}
        found = _flat_tensors(args, kwargs)
        assert found is not None and found.keys() == expected.keys()
        assert all(found[i] is expected[i] for i in expected)
    assert _flat_tensors((a, [[b]]), {}) is None
    assert _flat_tensors((a,), {"x": {"y": b}}) is None
