"""Policies: presets, the override priority order, validation, and what is never cast."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from amp_graph.passes import AMP, Role
from conftest import PlanReference, compile_checked

import amp_graph
from amp_graph.demo import models
from amp_graph.policy import Policy, Rule

IDX = (torch.randint(0, 64, (2, 8)),)


def node_by_module(compiled, path):
    matches = [
        n
        for n in compiled.graph.nodes
        if n.meta[AMP].role is Role.OP and n.meta[AMP].module_path == path
    ]
    assert matches, f"no op node in module {path}"
    return matches[0].meta[AMP]


def test_o1_classifies_by_torch_autocast_cuda_lists():
    compiled = compile_checked(models.GPT(), "O1", example_inputs=IDX)
    assert node_by_module(compiled, "blocks.0.attn.q").compute_dtype == torch.bfloat16
    assert node_by_module(compiled, "blocks.0.ln1").compute_dtype == torch.float32
    assert node_by_module(compiled, "blocks.0.ln1").source == "table"
    sdpa = [n for n in compiled.graph.nodes if n.meta[AMP].aten == "scaled_dot_product_attention"]
    assert sdpa and sdpa[0].meta[AMP].out_dtype == torch.bfloat16


def test_override_priority_order_default_table_op_type_path_node():
    base = Policy.preset("O1")
    op_level = base.override(ops={"linear": "fp32"})
    compiled = compile_checked(models.GPT(), op_level, example_inputs=IDX)
    q = node_by_module(compiled, "blocks.0.attn.q")
    assert q.rule is Rule.DENY and q.source == "op override"

    type_level = op_level.override(module_types={models.CausalSelfAttention: "allow"})
    compiled = compile_checked(models.GPT(), type_level, example_inputs=IDX)
    assert node_by_module(compiled, "blocks.0.attn.q").source == "module type"
    assert node_by_module(compiled, "blocks.0.attn.q").compute_dtype == torch.bfloat16
    assert node_by_module(compiled, "blocks.0.fc").rule is Rule.DENY  # outside attention

    path_level = type_level.override(modules={"blocks.0.attn": "fp32"})
    compiled = compile_checked(models.GPT(), path_level, example_inputs=IDX)
    assert node_by_module(compiled, "blocks.0.attn.q").source == "module path"
    assert node_by_module(compiled, "blocks.0.attn.q").rule is Rule.DENY
    assert node_by_module(compiled, "blocks.1.attn.q").rule is Rule.ALLOW  # other block

    q_name = next(
        n.name
        for n in compiled.graph.nodes
        if n.meta[AMP].module_path == "blocks.0.attn.q" and n.meta[AMP].role is Role.OP
    )
    node_level = path_level.override(nodes={q_name: "allow"})
    compiled = compile_checked(models.GPT(), node_level, example_inputs=IDX)
    info = node_by_module(compiled, "blocks.0.attn.q")
    assert info.source == "node" and info.compute_dtype == torch.bfloat16


def test_innermost_module_wins_and_globs_match_segments():
    policy = Policy.preset("O1").override(modules={"blocks.*": "fp32", "blocks.*.attn": "allow"})
    compiled = compile_checked(models.GPT(), policy, example_inputs=IDX)
    assert node_by_module(compiled, "blocks.1.attn.k").rule is Rule.ALLOW
    assert node_by_module(compiled, "blocks.1.fc").rule is Rule.DENY
    deep = Policy.preset("O1").override(modules={"**.k": "fp32"})
    compiled = compile_checked(models.GPT(), deep, example_inputs=IDX)
    assert node_by_module(compiled, "blocks.1.attn.k").rule is Rule.DENY
    assert node_by_module(compiled, "blocks.1.attn.q").rule is Rule.ALLOW


def test_keep_output_head_fp32():
    policy = Policy.preset("O1").override(modules={"head": amp_graph.KEEP_FP32})
    compiled = compile_checked(models.GPT(), policy, example_inputs=IDX)
    head = node_by_module(compiled, "head")
    assert head.compute_dtype == torch.float32 and head.out_dtype == torch.float32
    assert compiled(*IDX).dtype == torch.float32


def test_op_override_by_callable_and_module_type_keys():
    policy = Policy.preset("O1").override(ops={F.gelu: "allow", nn.LayerNorm: "allow"})
    compiled = compile_checked(models.GPT(), policy, example_inputs=IDX)
    gelus = [n.meta[AMP] for n in compiled.graph.nodes if n.meta[AMP].aten == "gelu"]
    assert gelus and all(g.rule is Rule.ALLOW and g.source == "op override" for g in gelus)
    assert node_by_module(compiled, "ln_f").compute_dtype == torch.bfloat16
    by_module_type = Policy.preset("O1").override(ops={nn.GELU: "fp32"})
    mlp = compile_checked(models.MLP(), by_module_type, example_inputs=(torch.randn(2, 64),))
    gelus = [n.meta[AMP] for n in mlp.graph.nodes if n.meta[AMP].aten == "gelu"]
    assert gelus and {g.compute_dtype for g in gelus} == {torch.float32}  # nn.GELU runs gelu


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ops": {"sofmax": "fp32"}}, "Did you mean 'softmax'"),
        ({"ops": {"softmax": "fp23"}}, "Did you mean 'fp32'"),
        ({"ops": {"softmax": None}}, "precision rule"),
        ({"module_types": {"LayerNorm": "fp32"}}, "nn.Module subclasses"),
    ],
)
def test_bad_overrides_fail_early(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        Policy.preset("O1").override(**kwargs)


def test_unknown_module_path_and_node_name_name_the_nearest():
    with pytest.raises(ValueError, match="Did you mean 'head'"):
        amp_graph.compile(models.GPT(), Policy.preset("O1").override(modules={"haed": "fp32"}))

    class Attention(nn.Module):
        def forward(self, q, k):
            return F.softmax(q @ k.transpose(-1, -2), dim=-1)

    q = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match="Did you mean 'softmax'"):  # known once captured
        amp_graph.compile(Attention(), Policy.preset("O1").override(nodes={"sotfmax": "fp32"}))(
            q, q
        )
    with pytest.raises(ValueError, match="names no node"):
        amp_graph.compile(
            models.MLP(),
            Policy.preset("O1").override(nodes={"zzz": "fp32"}),
            example_inputs=(torch.randn(2, 64),),
        )


def test_ambiguous_module_globs_are_an_error():
    policy = Policy.preset("O1").override(modules={"blocks.0.*": "fp32", "**.attn": "allow"})
    with pytest.raises(ValueError, match="different rules"):
        amp_graph.compile(models.GPT(), policy)


def test_o2_keeps_norms_and_fp32_list_in_fp32_and_casts_inputs_at_entry():
    compiled = compile_checked(models.MLP(), "O2", example_inputs=(torch.randn(2, 64),))
    entry = [
        n
        for n in compiled.graph.nodes
        if n.meta[AMP].role is Role.CAST and n.args[0].op == "placeholder"
    ]
    assert len(entry) == 1 and entry[0].args[1] == torch.bfloat16
    gelus = [n.meta[AMP] for n in compiled.graph.nodes if n.meta[AMP].aten == "gelu"]
    assert gelus and all(g.compute_dtype == torch.bfloat16 for g in gelus)  # no table: low

    gpt = compile_checked(models.GPT(), "O2", example_inputs=IDX)
    assert node_by_module(gpt, "blocks.0.ln1").compute_dtype == torch.float32
    adds = [n.meta[AMP] for n in gpt.graph.nodes if n.meta[AMP].aten == "add.Tensor"]
    assert adds and all(a.out_dtype == torch.bfloat16 for a in adds)

    # batch norm reads the bf16 activation itself (float32 weights and statistics, float32
    # arithmetic inside the kernel): no casts around it, as in Apex's O2
    cnn = compile_checked(models.ConvNet(), "O2", example_inputs=(torch.randn(2, 1, 8, 8),))
    bn = next(n for n in cnn.graph.nodes if n.meta[AMP].aten == "batch_norm")
    assert bn.meta[AMP].module_path == "bn"
    assert bn.meta[AMP].rule is Rule.FOLLOW and bn.meta[AMP].out_dtype == torch.bfloat16
    assert all(a.meta[AMP].role is not Role.CAST for a in bn.all_input_nodes)
    assert [u.meta[AMP].role for u in bn.users] == [Role.OP]
    assert cnn.model.bn.weight.dtype == torch.float32


def test_o3_runs_everything_in_low_precision_and_o0_changes_nothing():
    gpt = compile_checked(models.GPT(), "O3", example_inputs=IDX)
    assert node_by_module(gpt, "blocks.0.ln1").compute_dtype == torch.bfloat16
    outs = {
        n.meta[AMP].out_dtype
        for n in gpt.graph.nodes
        if n.meta[AMP].role is Role.OP
        and isinstance(n.meta[AMP].out_dtype, torch.dtype)
        and n.meta[AMP].out_dtype.is_floating_point
    }
    assert outs == {torch.bfloat16}

    model = models.GPT()
    o0 = compile_checked(model, "O0", example_inputs=IDX)
    assert not any(n.meta[AMP].role is Role.CAST for n in o0.graph.nodes)
    assert torch.equal(o0(*IDX), model(*IDX))


@pytest.mark.parametrize("policy", ["O1", "O2", "O3", "autocast"])
def test_casts_the_model_wrote_are_kept_and_respected(policy):
    compiled = compile_checked(models.LlamaMLP(), policy, example_inputs=(torch.randn(2, 32),))
    infos = [n.meta[AMP] for n in compiled.graph.nodes]
    user_casts = [i for i in infos if i.role is Role.USER_CAST]
    assert {i.op for i in user_casts} == {"aten.to.dtype", "aten.type_as"}
    norm_ops = [
        i
        for i in infos
        if i.module_path == "norm"
        and i.role is Role.OP
        and i.aten.split(".")[0] in ("pow", "mean", "rsqrt", "mul", "add")
    ]
    # inside RMSNorm, between .float() and .type_as(x), everything stays float32
    assert norm_ops and all(i.out_dtype == torch.float32 for i in norm_ops[:-1])


def test_inplace_ops_int_bool_and_fp64_values_are_never_cast():
    compiled = compile_checked(models.MixedOpsNet(), "O3", example_inputs=(torch.randn(4, 16),))
    for node in compiled.graph.nodes:
        info = node.meta[AMP]
        if info.role is Role.INPLACE:
            assert not any(a.meta[AMP].role is Role.CAST for a in node.all_input_nodes)
        if info.role is Role.CAST:
            assert node.args[0].meta[AMP].out_dtype in (
                torch.float32,
                torch.bfloat16,
                torch.float16,
            )

    class WithDouble(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, x64):
            return self.fc(x).sum() + (x64 * 2).sum()

    example = (torch.randn(2, 4), torch.randn(2, 4, dtype=torch.float64))
    compiled = compile_checked(WithDouble(), "O3", example_inputs=example)
    sources = {n.args[0].name for n in compiled.graph.nodes if n.meta[AMP].role is Role.CAST}
    assert "x64" not in sources
    assert compiled(*example).dtype == torch.float64


def test_autocast_preset_uses_the_device_lists():
    compiled = compile_checked(
        nn.Sequential(nn.Linear(4, 4), nn.Softmax(-1)),
        "autocast",
        example_inputs=(torch.randn(2, 4),),
    )
    assert compiled.meta["amp_graph"].policy.name == "autocast[cpu]"
    softmax = next(n.meta[AMP] for n in compiled.graph.nodes if n.meta[AMP].aten == "softmax.int")
    assert softmax.rule is Rule.FOLLOW  # not in torch.autocast's CPU lists (it is in CUDA's)
    x = torch.randn(2, 4)
    with torch.autocast("cpu", torch.bfloat16):
        reference = compiled.meta["amp_graph"].original(x)
    assert torch.equal(compiled(x), reference)


@pytest.mark.parametrize("policy", ["O1", "O2", "O3"])
def test_plan_reference_matches_bitwise(policy):
    model = models.GPT().eval()
    compiled = compile_checked(model, policy, example_inputs=IDX)
    assert torch.equal(compiled(*IDX), PlanReference(compiled).run(*IDX))


def test_changes_nothing_is_o0_without_overrides_or_fp8() -> None:
    """What the capture asks before telling FSDP2 users that O0 leaves their units' inputs
    float32: O0 as preset changes nothing; an override or fp8 on top of it may."""
    o0 = Policy.preset("O0")
    assert o0.casts_nothing and o0.changes_nothing
    assert not o0.override(modules={"blocks.*": "allow"}).changes_nothing
    assert not o0.override(ops={"linear": "allow"}).changes_nothing
    assert not dataclasses.replace(o0, fp8=Policy.preset("fp8").fp8).changes_nothing
    assert not Policy.preset("O1").changes_nothing


def _node_inside(path: str, recorded_type: str) -> tuple[torch.fx.Node, torch.fx.GraphModule]:
    """A graph whose one op records, as export does, an enclosing module by path and type
    name, in a root that has no module at that path."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    op = graph.call_function(torch.ops.aten.relu.default, (x,))
    op.meta["nn_module_stack"] = {"m": (path, recorded_type)}
    graph.output(op)
    return op, torch.fx.GraphModule(nn.Module(), graph)


def test_a_module_the_model_lacks_gets_its_recorded_class_where_it_is_imported(caplog) -> None:
    from amp_graph.passes.classify import module_stack

    op, gm = _node_inside("encoder.fc", "torch.nn.modules.linear.Linear")
    with caplog.at_level("WARNING", logger="amp_graph.passes.classify"):
        paths, types = module_stack(op, gm)
    assert paths == ("", "encoder.fc") and types[1] is nn.Linear  # module_types can match it
    assert not caplog.records
    op, gm = _node_inside("encoder.fc", "<class 'torch.nn.modules.linear.Linear'>")
    assert module_stack(op, gm)[1][1] is nn.Linear


def test_a_module_found_nowhere_is_a_warning_that_module_types_miss_it(caplog) -> None:
    from amp_graph.passes.classify import module_stack

    op, gm = _node_inside("encoder.fc", "some_library_never_imported.layers.FusedDense")
    with caplog.at_level("WARNING", logger="amp_graph.passes.classify"):
        types = module_stack(op, gm)[1]
    assert types[1] is nn.Module
    [said] = [r.getMessage() for r in caplog.records]
    assert "'encoder.fc'" in said and "FusedDense" in said and "module_types" in said
