"""``output_dtype=torch.float32`` (``Policy.output_dtype``, passes/cast_outputs.py): a loss
computed on a compiled model's outputs outside the graph runs in float32, as torch.autocast
runs it when the loss is written inside the autocast region. The oracle is that autocast
step, bit for bit: the loss's value and every parameter's gradient."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from amp_graph.passes import AMP, Role

import amp_graph
from tests.conftest import compile_checked
from tests.hf_configs import small_llama_config
from tests.zoo import GPTConfig, NanoGPT

BF16 = torch.bfloat16
F32 = torch.float32


def _nanogpt():
    torch.manual_seed(0)
    model = NanoGPT(GPTConfig(n_layer=2, n_embd=32, vocab_size=96)).train()
    ids = torch.randint(0, 96, (4, 16))
    targets = torch.randint(0, 96, (4,))

    def logits(out):  # nanoGPT without targets: the last position's logits, and no loss
        return out[0][:, -1, :]

    return model, (ids,), logits, targets


def _llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = small_llama_config()
    config._attn_implementation = "eager"  # as test_shared_cast_gradients: no SDPA mask skip
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 100, (2, 16))
    targets = torch.randint(0, 100, (2 * 16,))
    return model, (ids,), lambda out: out.logits.flatten(0, 1), targets


LOSSES = {
    "cross_entropy": lambda logits, targets: F.cross_entropy(logits, targets),
    "mse_loss": lambda logits, targets: F.mse_loss(
        logits, F.one_hot(targets, logits.shape[-1]).to(logits.dtype)
    ),
}


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _loss_inside_autocast(model, inputs, logits, targets, loss_fn):
    """torch.amp's pattern: the forward and the loss inside the autocast region."""
    with torch.autocast("cpu", BF16):
        loss = loss_fn(logits(model(*inputs)), targets)
    loss.backward()
    return loss, _grads(model)


def _loss_outside(compiled, model, inputs, logits, targets, loss_fn):
    """amp_graph's pattern: the compiled model called, the loss computed on its outputs,
    no autocast anywhere."""
    loss = loss_fn(logits(compiled(*inputs)), targets)
    loss.backward()
    return loss, _grads(model)


@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("build", [_nanogpt, _llama], ids=["nanogpt", "hf_llama"])
def test_a_loss_outside_the_graph_is_autocasts_bit_for_bit(build, loss_name) -> None:
    model, inputs, logits, targets = build()
    loss_fn = LOSSES[loss_name]
    expected_loss, expected = _loss_inside_autocast(
        copy.deepcopy(model), inputs, logits, targets, loss_fn
    )
    assert expected_loss.dtype == F32  # autocast runs the loss in float32

    ours = copy.deepcopy(model)
    compiled = amp_graph.compile(ours, "autocast", BF16, output_dtype=F32)
    loss, grads = _loss_outside(compiled, ours, inputs, logits, targets, loss_fn)
    assert loss.dtype == F32
    assert torch.equal(loss, expected_loss)
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, expected[name]), name

    # without it the outputs come back bf16, as autocast returns them, and the same loss
    # code then computes in bf16: another value than autocast's
    low = copy.deepcopy(model)
    as_computed = amp_graph.compile(low, "autocast", BF16)
    loss, _ = _loss_outside(as_computed, low, inputs, logits, targets, loss_fn)
    assert loss.dtype == BF16
    assert not torch.equal(loss.float(), expected_loss)


@pytest.mark.parametrize("policy", ["O1", "O2", "O3", "fp8"])
def test_every_preset_returns_the_values_it_computes_in_float32(policy) -> None:
    """The cast is exact and the only change: each output is the low output upcast, and a
    loss on it has the gradients of ``loss_fn(out.float(), y)`` on the low outputs."""
    model, inputs, logits, targets = _nanogpt()
    low = copy.deepcopy(model)
    out = amp_graph.compile(low, policy, BF16, output_dtype=None)(*inputs)  # as computed
    assert logits(out).dtype == BF16
    F.cross_entropy(logits(out).float(), targets).backward()

    ours = copy.deepcopy(model)
    compiled = amp_graph.compile(ours, policy, BF16, output_dtype=F32)
    got = compiled(*inputs)
    assert logits(got).dtype == F32
    assert torch.equal(logits(got), logits(out).float())
    F.cross_entropy(logits(got), targets).backward()
    expected = _grads(low)
    for name, grad in _grads(ours).items():
        assert torch.equal(grad, expected[name]), name


class ManyOutputs(nn.Module):
    """Outputs of every kind: a low product (twice), a float32 softmax of it (whose input
    cast the output shares), an integer argmax, and a float64 value."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor):
        h = self.fc(x)
        return self.head(h), h, torch.softmax(h, -1), x.argmax(-1), x.double().sum(), h


def _casts_of(gm: fx.GraphModule, name: str) -> list[fx.Node]:
    source = next(n for n in gm.graph.nodes if n.name == name)
    return [u for u in source.users if u.meta[AMP].role is Role.CAST]


def test_each_low_output_is_cast_once_and_nothing_else_changes() -> None:
    x = torch.randn(2, 8)
    model = ManyOutputs()
    plain = compile_checked(model, "O1", example_inputs=(x,))
    compiled = amp_graph.compile(
        model, "O1", BF16, output_dtype=F32, example_inputs=(x,), check_each_pass=True
    )
    got, want = compiled(x), plain(x)
    assert [t.dtype for t in want] == [BF16, BF16, F32, torch.int64, torch.float64, BF16]
    assert [t.dtype for t in got] == [F32, F32, F32, torch.int64, torch.float64, F32]
    for ours, theirs in zip(got, want, strict=True):
        assert torch.equal(ours, theirs.to(ours.dtype))

    gm = compiled.graph_module
    stats = gm.meta["amp_graph"].stats
    assert stats["outputs_cast"] == 2  # the head's product, and h (returned twice)
    # h's float32 copy serves softmax and both outputs: one cast per (value, dtype)
    (h_fp32,) = [c for c in _casts_of(gm, "linear") if c.args[1] == F32]
    returned = gm.graph.output_node().args[0]
    assert returned[1] is h_fp32 and returned[5] is h_fp32
    assert any(u.target is torch.ops.aten.softmax.int for u in h_fp32.users)
    # two cast nodes more than without: the head's, and h's float32 copy, which the plain
    # graph's softmax makes itself (its cast absorbed into its dtype=) and the output shares
    kept = sum(n.meta[AMP].role is Role.CAST for n in gm.graph.nodes)
    plain_kept = sum(n.meta[AMP].role is Role.CAST for n in plain.graph_module.graph.nodes)
    assert kept == plain_kept + 2
    assert plain.graph_module.meta["amp_graph"].stats["casts_absorbed"] == 1
    assert stats.get("casts_absorbed", 0) == 0

    report = amp_graph.report(compiled)
    assert report.outputs_cast == 2
    assert "2 returning outputs in fp32: output_dtype" in report.totals()
    assert report.casts_inserted - report.casts_removed == report.casts_kept


def test_compile_in_place_and_policy_field_agree() -> None:
    x = torch.randn(2, 8)
    policy = dataclasses.replace(amp_graph.Policy.preset("O1"), output_dtype=F32)
    by_field = amp_graph.compile(ManyOutputs(), policy, BF16)(x)
    model = amp_graph.compile_(ManyOutputs(), "O1", BF16, output_dtype=F32)
    in_place = model(x)
    assert [t.dtype for t in by_field] == [t.dtype for t in in_place]
    assert in_place[0].dtype == F32


def test_the_repr_shows_it_where_the_policys_name_does_not() -> None:
    asked = amp_graph.compile(ManyOutputs(), "O1", BF16, output_dtype=F32)
    assert "policy=O1, dtype=bf16, output_dtype=fp32, mode=" in repr(asked)
    assert "output_dtype" not in repr(amp_graph.compile(ManyOutputs(), "O1", BF16))
    as_computed = amp_graph.compile(ManyOutputs(), "O2", BF16, output_dtype=None)
    assert "output_dtype" not in repr(as_computed)
    assert "output_dtype=fp32" in repr(amp_graph.compile(ManyOutputs(), "O2", BF16))


@pytest.mark.parametrize(
    ("policy", "flag", "returned", "report"),
    [
        ("O1", "policy", BF16, ""),
        ("O1", "float32", F32, "(1 returning outputs in fp32: output_dtype)"),
        ("O2", "policy", F32, "(1 returning outputs in fp32: output_dtype)"),
        ("O2", "none", BF16, ""),
    ],
)
def test_the_command_lines_output_dtype(policy, flag, returned, report, capsys) -> None:
    """``amp-graph inspect|explain|export --output-dtype``: the policy's own, float32 or as
    computed; the compiled model returns what it says and the report counts the casts."""
    from amp_graph.cli import build_parser, compile_model_and_inputs, main

    sample = f"{Path(__file__).with_name('sample_model.py')}:make_tagger"
    args = [sample, "--input-shape", "2,7", "--input-dtype", "long", "--policy", policy]
    args += ["--output-dtype", flag]
    compiled, inputs = compile_model_and_inputs(build_parser().parse_args(["inspect", *args]))
    assert compiled(*inputs).dtype == returned
    assert main(["inspect", *args, "--summary"]) == 0
    out = capsys.readouterr().out
    assert report in out if report else "returning outputs in fp32" not in out


@pytest.mark.parametrize("bad", [BF16, torch.float16, torch.float64, "float32"])
def test_an_output_dtype_other_than_float32_is_refused(bad) -> None:
    with pytest.raises(ValueError, match=r"output_dtype is torch\.float32"):
        dataclasses.replace(amp_graph.Policy.preset("O1"), output_dtype=bad)
    with pytest.raises(ValueError, match=r"output_dtype is torch\.float32"):
        amp_graph.compile(ManyOutputs(), "O1", BF16, output_dtype=bad)


def test_the_backend_refuses_it_saying_what_to_do() -> None:
    policy = dataclasses.replace(amp_graph.Policy.preset("O1"), output_dtype=F32)
    with pytest.raises(ValueError, match=r"loss_fn\(out.float\(\), y\)"):
        amp_graph.backend(policy)


def test_generate_decodes_with_low_caches_and_logits_as_computed() -> None:
    """Decode graphs return the cache's tensors, which the next step reads: they stay low,
    and the whole generation is the one without output_dtype, token for token."""
    transformers = pytest.importorskip("transformers")
    config = small_llama_config()
    config.bos_token_id = config.eos_token_id = config.pad_token_id = 0
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    prompt = torch.randint(1, 100, (2, 4), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=4, do_sample=False, use_cache=True)

    expected = amp_graph.compile(copy.deepcopy(model), "O1", BF16).generate(prompt, **kwargs)
    compiled = amp_graph.compile(model, "O1", BF16, output_dtype=F32)
    assert torch.equal(compiled.generate(prompt, **kwargs), expected)
    assert compiled(prompt).logits.dtype == F32  # the forward's outputs are float32
    decode_graphs = compiled.decoder.graph_modules
    assert decode_graphs
    for gm in decode_graphs:
        assert "outputs_cast" not in gm.meta["amp_graph"].stats
        returned = [n for n in gm.graph.output_node().all_input_nodes]
        assert any(n.meta[AMP].out_dtype == BF16 for n in returned)  # keys and values


class LogitsStep(amp_graph.Graph):
    def __init__(self, model: nn.Module, policy: amp_graph.Policy) -> None:
        super().__init__()
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        self.add_optimizer(self.optimizer)
        self.config.enable_amp(True, policy=policy, dtype=BF16)

    def build(self, x: torch.Tensor, y: torch.Tensor):
        logits = self.model(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        return loss, logits


def test_a_graph_step_returns_its_outputs_in_float32_and_trains_the_same() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    steps = {}
    for returned_in in (None, F32):
        policy = dataclasses.replace(amp_graph.Policy.preset("O1"), output_dtype=returned_in)
        trained = copy.deepcopy(model)
        step = LogitsStep(trained, policy)
        outputs = [step(x, y) for _ in range(3)]
        steps[returned_in] = (outputs, trained)
    (low_outputs, low_model), (f32_outputs, f32_model) = steps[None], steps[F32]
    assert low_outputs[-1][1].dtype == BF16 and f32_outputs[-1][1].dtype == F32
    for (low_loss, low_logits), (loss, logits) in zip(low_outputs, f32_outputs, strict=True):
        assert torch.equal(loss, low_loss)
        assert torch.equal(logits, low_logits.float())
    for a, b in zip(low_model.parameters(), f32_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_an_exported_program_returns_float32() -> None:
    x = torch.randn(2, 8)
    policy = dataclasses.replace(amp_graph.Policy.preset("O1"), output_dtype=F32)
    got = amp_graph.export(ManyOutputs(), (x,), policy=policy, dtype=BF16).module()(x)
    assert [t.dtype for t in got] == [F32, F32, F32, torch.int64, torch.float64, F32]
    # O2's program returns float32 as Apex O2's model does; as computed, it returns bf16
    o2 = amp_graph.export(ManyOutputs(), (x,), policy="O2", dtype=BF16).module()(x)
    assert o2[0].dtype == F32
    as_computed = dataclasses.replace(amp_graph.Policy.preset("O2"), output_dtype=None)
    low = amp_graph.export(ManyOutputs(), (x,), policy=as_computed, dtype=BF16).module()(x)
    assert low[0].dtype == BF16


def test_o2_and_o3_return_float32_as_apex_does() -> None:
    """Apex's O2 and O3 patch the model's forward to cast its outputs to float32 ("so the
    user never needs to call .half()"), beside the inputs' cast to the low dtype: the presets
    do the same; O1, ``"autocast"`` and fp8 return outputs as torch.autocast does."""
    assert {name: amp_graph.Policy.preset(name).output_dtype for name in amp_graph.PRESETS} == {
        "O0": None,
        "O1": None,
        "O2": F32,
        "O3": F32,
        "autocast": None,
        "fp8": None,
    }
    x = torch.randn(2, 8)
    for name in ("O2", "O3"):
        apex_like = amp_graph.compile(ManyOutputs(), name, BF16)(x)
        as_computed = amp_graph.compile(ManyOutputs(), name, BF16, output_dtype=None)(x)
        assert apex_like[0].dtype == F32 and as_computed[0].dtype == BF16


class BrokenUp(nn.Module):
    """Two dynamo graphs: the first one's low output is the second one's input."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        torch._dynamo.graph_break()
        return self.fc2(h * 2.0)


def _backend_step(policy, x: torch.Tensor):
    torch.manual_seed(0)
    model = BrokenUp()
    compiled = torch.compile(model, backend=amp_graph.backend(policy, BF16, inner="eager"))
    out = compiled(x)
    out.float().sum().backward()
    return out, {name: p.grad for name, p in model.named_parameters()}, compiled


def test_the_backend_applies_it_where_every_graph_casts_its_inputs(fresh_dynamo) -> None:
    """Under O2 each dynamo graph casts its inputs to bf16 at entry: the first graph's output
    cast to float32 is cast back exactly, so the outputs and gradients are those of O2 with
    outputs as computed, the last output upcast. Without ``cast_inputs`` it is refused."""
    x = torch.randn(4, 8)
    out, grads, compiled = _backend_step("O2", x)
    assert len(amp_graph.captured_graphs(compiled)) == 2
    assert all(
        gm.meta["amp_graph"].stats["outputs_cast"] == 1
        for gm in amp_graph.captured_graphs(compiled)
    )
    torch._dynamo.reset()
    as_computed = dataclasses.replace(amp_graph.Policy.preset("O2"), output_dtype=None)
    low, low_grads, _ = _backend_step(as_computed, x)
    assert out.dtype == F32 and low.dtype == BF16
    assert torch.equal(out, low.float())
    for name, grad in grads.items():
        assert torch.equal(grad, low_grads[name]), name
