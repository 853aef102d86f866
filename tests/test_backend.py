"""The torch.compile backend: dynamo's graphs get the same dtypes as ``amp_graph.compile``
and the same numbers as torch.autocast, across graph breaks, dynamic shapes, no_grad,
training and recompilation. Inner backends here are "eager"/"aot_eager" (fast); inductor
runs in test_backend_inductor.py, DDP in test_backend_ddp.py."""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from amp_graph.passes import AMP, Role

import amp_graph
from amp_graph.demo import models
from amp_graph.frontends import dynamo_backend
from amp_graph.frontends.dynamo_backend import (
    AmpGraphBackend,
    amp_graph_backend,
    backend,
    captured_graphs,
    register,
)

# The module itself: amp_graph exports the function `backend` under the module's name.

BF16 = torch.bfloat16


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def checked(policy="O1", inner="eager", dtype=BF16) -> AmpGraphBackend:
    return backend(policy, dtype, inner=inner, check_each_pass=True)


def out_dtypes(gm) -> dict[tuple[str, int], torch.dtype]:
    """Output dtype of every computing node, keyed by (module path, position in that module):
    stable across symbolic tracing and dynamo, which name and spell ops differently."""
    seen: Counter = Counter()
    dtypes = {}
    for node in gm.graph.nodes:
        amp = node.meta[AMP]
        if amp.role not in (Role.OP, Role.USER_CAST, Role.INPLACE):
            continue
        if not (isinstance(amp.out_dtype, torch.dtype) and amp.out_dtype.is_floating_point):
            continue  # sizes, masks, indices, BatchNorm's num_batches_tracked (dynamo only)
        dtypes[(amp.module_path, seen[amp.module_path])] = amp.out_dtype
        seen[amp.module_path] += 1
    return dtypes


def autocast_eager(model, *args):
    with torch.autocast("cpu", BF16):
        return model(*args)


def tokens(batch=2, length=16, vocab=64):
    return torch.randint(0, vocab, (batch, length))


CASES = {
    "MLP": (models.MLP, lambda: (torch.randn(4, 64),)),
    "ConvNet": (models.ConvNet, lambda: (torch.randn(2, 1, 8, 8),)),
    "GPT": (models.GPT, lambda: (tokens(),)),
    "GPTWithLoss": (models.GPTWithLoss, lambda: (tokens(), tokens())),
    "LlamaMLP": (models.LlamaMLP, lambda: (torch.randn(2, 32),)),
    "MixedOpsNet": (models.MixedOpsNet, lambda: (torch.randn(4, 16),)),
}
POLICY_CASES = [(name, "O1") for name in CASES] + [
    (name, policy)
    for name in ("ConvNet", "GPT", "LlamaMLP")
    for policy in ("O0", "O2", "O3", "autocast")
]


# ---- same decisions as amp_graph.compile ----------------------------------------------


@pytest.mark.parametrize(("name", "policy"), POLICY_CASES)
def test_per_op_dtypes_and_outputs_equal_amp_graph_compile(name, policy):
    factory, make_inputs = CASES[name]
    model, inputs = factory(), make_inputs()
    reference = amp_graph.compile(model, policy, BF16, example_inputs=inputs)
    compiled = torch.compile(model, backend=checked(policy))
    out = compiled(*inputs)
    [gm] = captured_graphs(compiled)
    assert gm.meta["amp_graph"].exact
    ours, theirs = out_dtypes(gm), out_dtypes(reference)
    assert ours == theirs
    assert len(ours) >= 4
    assert torch.equal(out, reference(*inputs))


@pytest.mark.parametrize("name", list(CASES))
def test_numerics_equal_torch_autocast(name):
    """policy="autocast" is torch.autocast's op lists: the same dtypes give the same bits,
    against eager autocast and against torch.compile(model) run under autocast."""
    factory, make_inputs = CASES[name]
    model, inputs = factory(), make_inputs()
    if name == "ConvNet":
        model.eval()  # batch norm in training mode would update its statistics per call
    expected = autocast_eager(model, *inputs)
    ours = torch.compile(model, backend=checked("autocast"))(*inputs)
    assert ours.dtype == expected.dtype
    assert torch.equal(ours, expected)
    torch._dynamo.reset()
    with torch.autocast("cpu", BF16):
        compiled_ref = torch.compile(model, backend="aot_eager")(*inputs)
    ours_aot = torch.compile(model, backend=checked("autocast", "aot_eager"))(*inputs)
    assert torch.equal(ours_aot, compiled_ref)


def test_dynamo_graph_shapes_are_handled():
    """Parameters arrive as placeholders, layers as torch functions, arithmetic as operator
    calls; each gets its rule and parameters are cast where they are used."""
    model, x = models.MLP(), torch.randn(4, 64)
    compiled = torch.compile(model, backend=checked())
    compiled(x)
    [gm] = captured_graphs(compiled)
    params = [n for n in gm.graph.nodes if n.op == "placeholder" and n.meta[AMP].role is Role.PARAM]
    assert len(params) == len(list(model.parameters()))
    linears = [n for n in gm.graph.nodes if n.meta[AMP].aten == "linear"]
    assert [n.meta[AMP].module_path for n in linears] == ["fc1", "fc2", "head"]
    for node in linears:
        assert node.meta[AMP].compute_dtype == BF16
        weight = node.args[1]
        assert weight.meta[AMP].role is Role.CAST and weight.args[0].meta[AMP].role is Role.PARAM
    report = amp_graph.report(gm)
    assert report.row(linears[0].name).out == "bf16"
    assert "allow" in amp_graph.explain(gm, linears[0].name)


def test_model_state_is_never_cast_at_entry():
    """O2 casts graph inputs at entry; dynamo's parameter and buffer placeholders are model
    state, not inputs, so only ops cast them (as with get_attr in amp_graph.compile)."""
    model, x = models.ConvNet(), torch.randn(2, 1, 8, 8)
    compiled = torch.compile(model, backend=checked("O2"))
    compiled(x)
    [gm] = captured_graphs(compiled)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    entry_cast = [n.name for n in placeholders if n.meta[AMP].compute_dtype is not None]
    assert entry_cast == ["l_x_"]
    assert sum(n.meta[AMP].role is Role.PARAM for n in placeholders) == len(placeholders) - 1


def test_batch_norm_statistics_update_under_o3():
    """Dynamo inlines BatchNorm into F.batch_norm, which updates running statistics in
    place: casting them (O3 allows everything) would update a copy."""
    model, x = models.ConvNet(), torch.randn(4, 1, 8, 8)
    reference = copy.deepcopy(model)
    torch.compile(model, backend=checked("O3"))(x)
    amp_graph.compile(reference, "O3", BF16)(x)
    assert model.bn.running_mean.abs().sum() > 0
    assert torch.equal(model.bn.running_mean, reference.bn.running_mean)
    assert torch.equal(model.block2.bn2.running_var, reference.block2.bn2.running_var)


# ---- casts written in the model ---------------------------------------------------------


@pytest.mark.parametrize("policy", ["O1", "O3"])
def test_explicit_fp32_upcast_is_kept(policy):
    """Llama's RMSNorm computes in float32 on purpose: `x.float()` stays, and what follows
    it in the norm stays float32 even where the policy's default is low precision."""
    model, x = models.LlamaMLP(), torch.randn(2, 32)
    compiled = torch.compile(model, backend=checked(policy))
    out = compiled(x)
    [gm] = captured_graphs(compiled)
    user_casts = [n for n in gm.graph.nodes if n.meta[AMP].role is Role.USER_CAST]
    assert [n.meta[AMP].op for n in user_casts] == ["aten.to.dtype", "aten.type_as"]
    upcast, downcast = user_casts
    norm_ops = [
        n
        for n in gm.graph.nodes
        if n.meta[AMP].module_path == "norm"
        and n.meta[AMP].role is Role.OP
        and upcast in _ancestors(n)
        and n is not upcast
        and downcast not in _ancestors(n)
    ]
    assert len(norm_ops) >= 4  # pow, mean, add, rsqrt, mul
    assert all(n.meta[AMP].out_dtype == torch.float32 for n in norm_ops)
    gates = [n for n in gm.graph.nodes if n.meta[AMP].aten == "linear"]
    assert all(n.meta[AMP].compute_dtype == BF16 for n in gates)
    assert torch.equal(out, amp_graph.compile(model, policy, BF16)(x))


def _ancestors(node):
    seen, stack = set(), list(node.all_input_nodes)
    while stack:
        item = stack.pop()
        if item not in seen:
            seen.add(item)
            stack += item.all_input_nodes
    return seen


# ---- graph breaks ------------------------------------------------------------------------


class BreakNet(nn.Module):
    """Breaks dynamo's graph three times: a print, a data-dependent if, and .item()."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, dim)
        self.fc2 = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        print("BreakNet: a graph break")
        if h.sum() > 0:  # noqa: SIM108 - a data-dependent if statement is the point
            h = torch.softmax(h, -1)
        else:
            h = torch.log_softmax(h, -1)
        scale = h.abs().mean().item()
        return self.head(torch.relu(self.fc2(h * scale)))


def _tensor_inputs(gm):
    return {
        n.name: n.meta["val"].dtype
        for n in gm.graph.nodes
        if n.op == "placeholder" and n.meta[AMP].role is Role.INPUT
    }


def test_graph_breaks_hand_each_graph_the_dtype_it_was_traced_with(capsys):
    model, x = BreakNet(), torch.randn(4, 16)
    if model.fc1(x).sum() <= 0:
        x = -x  # take the softmax branch
    compiled = torch.compile(model, backend=checked("O1"))
    compiled(x)
    graphs = captured_graphs(compiled)
    assert len(graphs) == 4, [gm.code for gm in graphs]
    first, condition, softmax, tail = graphs
    # fc1's output leaves graph 1 as bf16 and enters graphs 2 and 3 as bf16 ...
    assert first.meta["amp_graph"].stats["casts_inserted"] > 0
    assert [n.meta[AMP].out_dtype for n in first.graph.nodes if n.op == "output"] == [(BF16,)]
    assert _tensor_inputs(condition) == {"l_h_": BF16}
    assert _tensor_inputs(softmax) == {"l_h_": BF16}
    # ... where O1's fp32 softmax widens it (by its dtype=: the cast absorbed), so the value
    # crossing the last break is fp32
    [soft] = [n for n in softmax.graph.nodes if n.meta[AMP].aten == "softmax.int"]
    assert soft.meta[AMP].cast_absorbed and soft.args[2] is torch.float32
    assert soft.args[0].meta[AMP].out_dtype == BF16 and soft.meta[AMP].out_dtype == torch.float32
    assert _tensor_inputs(tail) == {"l_h_": torch.float32}
    assert all(gm.meta["amp_graph"].exact for gm in graphs)
    # At run time every graph gets exactly the dtypes it was compiled for: no recompiles.
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled(x)
    assert len(captured_graphs(compiled)) == 4
    assert capsys.readouterr().out.count("a graph break") == 2


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_graph_break_model_matches_torch_autocast(sign):
    model = BreakNet()
    x = sign * torch.randn(4, 16)
    out = torch.compile(model, backend=checked("autocast"))(x)
    assert torch.equal(out, autocast_eager(model, x))


# ---- dynamic shapes, inference, training, recompilation ---------------------------------


def test_dynamic_shapes_two_sequence_lengths():
    model = models.GPT()
    compiled = torch.compile(model, backend=checked("autocast"), dynamic=True)
    for length in (8, 16, 24):
        idx = tokens(length=length)
        assert torch.equal(compiled(idx), autocast_eager(model, idx))
    [gm] = captured_graphs(compiled)  # one graph for every length
    placeholders = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    assert any(isinstance(value, torch.SymInt) for value in placeholders)
    assert gm.meta["amp_graph"].exact
    report = amp_graph.report(gm)
    assert report.cast_bytes is None  # symbolic shapes: bytes are not a number
    assert report.ops_by_dtype["bf16"] >= 8


def test_no_grad_inference():
    model, idx = models.GPT(), tokens()
    compiled = torch.compile(model, backend=checked("autocast"))
    with torch.no_grad():
        out = compiled(idx)
        expected = autocast_eager(model, idx)
    assert not out.requires_grad
    assert out.dtype == BF16
    assert torch.equal(out, expected)


def _train(model, step_fn, steps=4):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    losses, first_grads = [], None
    for _ in range(steps):  # one batch, learned by heart: the loss must fall
        loss = step_fn(idx, torch.roll(idx, -1, dims=1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        first_grads = first_grads or {name: p.grad.clone() for name, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return losses, first_grads


def test_training_loop_through_aot_autograd_matches_torch_autocast():
    """Forward, backward (AOTAutograd) and AdamW through the backend, against eager
    torch.autocast training: the same losses step for step, gradients reaching the fp32
    parameters as fp32 and equal up to bf16 rounding. (Not bit-equal: simplify_casts shares
    one cast among the consumers of an activation, e.g. q, k and v of one LayerNorm, so
    their gradients are summed in bf16 where autocast, casting per consumer, sums in fp32.)"""
    model = models.GPTWithLoss()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend=checked("autocast", "aot_eager"))
    losses, grads = _train(model, compiled)
    ref_losses, ref_grads = _train(reference, lambda *a: autocast_eager(reference, *a))
    assert {g.dtype for g in grads.values()} == {torch.float32}
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert losses[-1] < losses[0] - 0.1
    torch.testing.assert_close(losses, ref_losses, rtol=1e-3, atol=1e-3)
    for name, grad in grads.items():  # within 1% of each gradient's scale (bf16 keeps 0.4%)
        scale = ref_grads[name].abs().max().item()
        assert (grad - ref_grads[name]).abs().max().item() <= 1e-2 * scale + 1e-6, name
    assert len(captured_graphs(compiled)) == 1


def test_recompiles_on_shape_and_dtype_change():
    model = models.MLP()
    compiled = torch.compile(model, backend=checked(), dynamic=False)
    compiled(torch.randn(4, 64))
    compiled(torch.randn(4, 64))
    assert len(captured_graphs(compiled)) == 1
    compiled(torch.randn(8, 64))  # new batch size: recompiled
    out = compiled(torch.randn(4, 64, dtype=BF16))  # new dtype: recompiled
    graphs = captured_graphs(compiled)
    assert len(graphs) == 3
    assert [_tensor_inputs(gm)["l_x_"] for gm in graphs] == [torch.float32, torch.float32, BF16]

    def first_linear_input(gm):
        return next(n for n in gm.graph.nodes if n.meta[AMP].aten == "linear").args[0]

    assert first_linear_input(graphs[0]).meta[AMP].role is Role.CAST  # fp32 input: cast
    assert first_linear_input(graphs[2]).meta[AMP].role is Role.OP  # bf16 input: none needed
    assert out.dtype == BF16


# ---- retrieval ---------------------------------------------------------------------------


def test_captured_graphs_belong_to_each_compile():
    mlp, conv = models.MLP(), models.ConvNet()
    compiled_mlp = torch.compile(mlp, backend=checked())
    compiled_conv = torch.compile(conv, backend=checked())
    assert captured_graphs(compiled_mlp) == []  # nothing until the first call
    compiled_mlp(torch.randn(2, 64))
    compiled_conv(torch.randn(2, 1, 8, 8))
    [gm_mlp], [gm_conv] = captured_graphs(compiled_mlp), captured_graphs(compiled_conv)
    assert gm_mlp is not gm_conv
    assert {n.meta[AMP].module_path for n in gm_mlp.graph.nodes} >= {"fc1", "head"}

    own = checked()
    compiled_fn = torch.compile(lambda x: F.gelu(mlp(x)) * 2, backend=own)
    compiled_fn(torch.randn(2, 64))
    assert captured_graphs(compiled_fn) == captured_graphs(own) == own.graphs
    assert len(own.graphs) == 1


def test_captured_graphs_of_the_registered_backend_and_of_others():
    compiled = torch.compile(models.MLP(), backend="amp_graph")  # not called: no inductor run
    assert captured_graphs(compiled) == dynamo_backend._DEFAULT.graphs
    with pytest.raises(TypeError, match="not compiled with the amp_graph backend"):
        captured_graphs(torch.compile(models.MLP(), backend="eager"))
    with pytest.raises(TypeError, match="not compiled with the amp_graph backend"):
        captured_graphs(models.MLP())


def test_inductor_settings_are_forwarded_and_refused_elsewhere(monkeypatch):
    import torch._inductor.compile_fx as compile_fx_module

    seen = {}

    def fake_compile_fx(gm, example_inputs, config_patches=None):
        seen["patches"] = config_patches
        return gm.forward

    monkeypatch.setattr(compile_fx_module, "compile_fx", fake_compile_fx)
    compiled = torch.compile(models.MLP(), backend=backend(), mode="max-autotune-no-cudagraphs")
    compiled(torch.randn(2, 64))
    assert seen["patches"]["max_autotune"] is True
    torch._dynamo.reset()
    compiled = torch.compile(models.MLP(), backend=backend(), options={"epilogue_fusion": False})
    compiled(torch.randn(2, 64))
    assert seen["patches"] == {"epilogue_fusion": False}
    torch._dynamo.reset()
    eager = torch.compile(models.MLP(), backend=backend(inner="eager"), options={"x": 1})
    with pytest.raises(Exception, match="configure inductor"):
        eager(torch.randn(2, 64))


def test_override_that_matches_nothing_is_reported(caplog):
    policy = amp_graph.Policy.preset("O1").override(modules={"haed": "fp32"})
    compiled = torch.compile(models.MLP(), backend=checked(policy))
    with caplog.at_level(logging.WARNING, logger="amp_graph.frontends.dynamo_backend"):
        compiled(torch.randn(2, 64))
    assert "'haed'" in caplog.text and "Did you mean 'head'?" in caplog.text


# ---- registration and bad input ---------------------------------------------------------


def test_registered_through_the_entry_point_or_on_import(monkeypatch):
    from torch._dynamo.backends import registry

    assert dynamo_backend._entry_point_installed()  # pyproject's torch_dynamo_backends
    assert registry.lookup_backend("amp_graph") is amp_graph_backend
    register()  # with the entry point installed: nothing to do, and no duplicate error
    # A source tree without the entry point: importing amp_graph registers the name.
    for table in ("_BACKENDS", "_COMPILER_FNS"):
        entries = getattr(registry, table)
        monkeypatch.setattr(registry, table, {k: v for k, v in entries.items() if k != "amp_graph"})
    monkeypatch.setattr(dynamo_backend, "_entry_point_installed", lambda: False)
    assert "amp_graph" not in torch._dynamo.list_backends(exclude_tags=())
    register()
    assert registry.lookup_backend("amp_graph") is amp_graph_backend


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"policy": "O4"}, ValueError, "unknown policy preset 'O4'.*Did you mean"),
        ({"policy": "autocats"}, ValueError, "Did you mean 'autocast'"),
        ({"policy": {"linear": "fp32"}}, TypeError, "preset name"),
        ({"dtype": torch.float32}, ValueError, "policy='O0'"),
        ({"dtype": "bf16"}, ValueError, "torch dtype object"),
        ({"inner": "indcutor"}, ValueError, "unknown inner backend.*Did you mean 'inductor'"),
        ({"inner": "amp_graph"}, ValueError, "run the passes twice"),
        ({"inner": 3}, TypeError, "backend callable"),
    ],
)
def test_bad_arguments_fail_when_the_backend_is_made(kwargs, error, match):
    with pytest.raises(error, match=match):
        backend(**kwargs)


def test_valid_arguments():
    assert backend().inner == "inductor"
    assert backend(amp_graph.Policy.preset("O2"), torch.float16, "aot_eager").dtype == torch.float16
    assert backend(inner="cudagraphs").inner == "cudagraphs"  # any registered dynamo backend
    custom = backend(inner=lambda gm, example_inputs: gm.forward)
    assert callable(custom.inner)
    assert "policy='O1'" in repr(backend())


@pytest.mark.parametrize("recompute", [True, False])
def test_a_callable_inner_that_gets_no_recompute_hooks_is_told_so(recompute, caplog) -> None:
    """An inner backend given as a callable may run the graph as it is, where the casts marked
    to recompute need hooks it does not get: a WARNING, once, with the ways out."""
    torch.manual_seed(0)
    policy = dataclasses.replace(amp_graph.Policy.preset("O1"), recompute_casts=recompute)
    as_it_is = backend(policy, BF16, inner=lambda gm, example_inputs: gm.forward)
    model = torch.compile(models.MLP(), backend=as_it_is)
    with caplog.at_level(logging.WARNING, logger="amp_graph.frontends.dynamo_backend"):
        for _ in range(2):
            model(torch.randn(4, 64)).float().sum().backward()
    said = [r.getMessage() for r in caplog.records if "no recompute hooks" in r.getMessage()]
    if recompute:
        [message] = said
        assert "inner='eager'" in message and "recompute_casts=False" in message
    else:
        assert not said


class VmappedHeads(nn.Module):
    """A linear per head through torch.vmap: dynamo inlines the transform's levels."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.vmap(torch.mm, in_dims=(None, 0))(x, self.weight).sum(0)


def test_a_functorch_transform_inline_is_refused_with_the_way_out():
    torch.manual_seed(0)
    model, x = VmappedHeads(), torch.randn(3, 8)
    dynamo = torch.compile(model, backend=amp_graph.backend("O1", torch.bfloat16, inner="eager"))
    with pytest.raises(Exception, match="cannot retrace a graph that runs a functorch") as raised:
        dynamo(x)
    assert "test_backend.py" in str(raised.value) and "amp_graph.compile" in str(raised.value)
    # the way out it names: compile captures the same model (CPU autocast's lists, to compare)
    compiled = amp_graph.compile(model, "autocast", torch.bfloat16)
    with torch.autocast("cpu", torch.bfloat16):
        expected = model(x)
    assert torch.equal(compiled(x), expected)
