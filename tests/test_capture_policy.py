"""Capture under the policy: code that reads a dtype sees the dtype the policy gives.

HF models read dtypes in their Python (GPT-2's eager attention ``.type(value.dtype)``,
Llama's RMSNorm ``.to(input_dtype)``, T5's ``.to(self.wo.weight.dtype)``); the dtype they
see during capture is baked into the graph. These tests hold:

* fp32 pins: a model wholly pinned to float32 equals the float32 model; an attention
  module pinned alone holds no low-precision value; autopolicy's demotions, applied to an
  HF attention that overflows in float16, remove the overflow;
* O2 and O3 are low: every matmul of HF GPT-2, BERT, Llama and T5 computes in the low
  dtype (Apex: the model is half), and the output stays near float32;
* what capture saw is what the graph computes: every node's captured dtype equals its
  planned one, on the front-end zoo and HF models, under every preset; through
  ``amp_graph.Graph`` too.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from amp_graph.passes import AMP, Role, schema
from amp_graph.passes.meta import DTYPE_READ
from graph_helpers import TrainGraph
from hf_configs import small_llama_config
from test_front_end import MODELS

import amp_graph

transformers = pytest.importorskip("transformers")

LOW = (torch.float16, torch.bfloat16)
MATMULS = frozenset(
    {"linear", "matmul", "bmm", "mm", "addmm", "baddbmm", "einsum", "scaled_dot_product_attention"}
)


def _ids() -> torch.Tensor:
    return torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))


def _hf(name: str) -> nn.Module:
    """Small random HF models, eval mode (no dropout); GPT-2 with its eager attention, which
    reads ``value.dtype``."""
    small = dict(vocab_size=100, use_cache=False)
    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(n_positions=32, n_embd=32, n_layer=2, n_head=2, **small)
        config._attn_implementation = "eager"
        model = transformers.GPT2LMHeadModel(config)
    elif name == "bert":
        model = transformers.BertForMaskedLM(
            transformers.BertConfig(
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=64,
                max_position_embeddings=32,
                **small,
            )
        )
    elif name == "llama":
        model = transformers.LlamaForCausalLM(small_llama_config())
    else:
        model = transformers.T5ForConditionalGeneration(
            transformers.T5Config(
                d_model=32,
                d_kv=8,
                d_ff=64,
                num_layers=2,
                num_heads=4,
                decoder_start_token_id=0,
                **small,
            )
        )
    return model.eval()


class Logits(nn.Module):
    """An HF model's logits, as a tensor (for autopolicy and comparisons)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.model, transformers.T5ForConditionalGeneration):
            return self.model(input_ids=ids, decoder_input_ids=ids).logits
        return self.model(input_ids=ids).logits


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _nodes(compiled):
    return list(amp_graph.frontends.compiler.as_graph_module(compiled).graph.nodes)


# --- fp32 pins hold --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama"])
def test_model_wholly_pinned_to_fp32_equals_the_fp32_model(name: str) -> None:
    model = Logits(_hf(name))
    policy = amp_graph.Policy.preset("O1").override(module_types={type(model): "fp32"})
    compiled = amp_graph.compile(model, policy, torch.bfloat16)
    with torch.no_grad():
        ours, reference = compiled(_ids()), model(_ids())
    low = [n.name for n in _nodes(compiled) if n.meta[AMP].out_dtype in LOW]
    assert not low, f"low-precision values in a model pinned to fp32: {low}"
    assert _rel(ours, reference) <= 1e-6


def test_attention_pinned_alone_holds_no_low_value() -> None:
    model = Logits(_hf("gpt2"))
    pinned = "model.transformer.h.0.attn"
    policy = amp_graph.Policy.preset("O1").override(modules={pinned: "fp32"})
    compiled = amp_graph.compile(model, policy, torch.bfloat16, example_inputs=(_ids(),))

    def inside(path: str, module: str) -> bool:
        return path == module or path.startswith(module + ".")

    amps = [n.meta[AMP] for n in _nodes(compiled)]
    in_pinned = [a for a in amps if inside(a.module_path or "", pinned) and a.role is not Role.CAST]
    assert len(in_pinned) > 10, "the pinned attention's nodes were found"
    assert [a.op for a in in_pinned if a.out_dtype in LOW or a.compute_dtype in LOW] == []
    # the other layer's attention is low, as O1 makes it
    other = [a for a in amps if inside(a.module_path or "", "model.transformer.h.1.attn")]
    assert any(a.compute_dtype in LOW for a in other)


def test_autopolicy_fix_for_an_overflowing_hf_attention_holds() -> None:
    model = Logits(_hf("gpt2"))
    with torch.no_grad():  # attention scores far beyond float16's range in layer 0
        model.model.transformer.h[0].attn.c_attn.weight.mul_(1000.0)
    ids = _ids()
    with torch.no_grad():
        reference = model(ids)
        broken = amp_graph.compile(model, "O1", torch.float16)(ids)
    assert not torch.isfinite(broken).all(), "the model must overflow in float16 under O1"

    fixed = amp_graph.autopolicy(model, "O1", torch.float16, sample_inputs=[(ids,)])
    assert fixed.nodes, "autopolicy demoted nothing"
    with torch.no_grad():
        out = amp_graph.compile(model, fixed, torch.float16)(ids)
    assert torch.isfinite(out).all()
    assert _rel(out, reference) < 1e-2


# --- O2 and O3 are low on HF models ----------------------------------------------------------


@pytest.mark.parametrize("policy", ["O2", "O3"])
@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "t5"])
def test_o2_o3_compute_every_hf_matmul_in_the_low_dtype(name: str, policy: str) -> None:
    model = Logits(_hf(name))
    compiled = amp_graph.compile(model, policy, torch.float16)
    with torch.no_grad():
        ours, reference = compiled(_ids()), model(_ids())
    matmuls = [
        (n.name, n.meta[AMP].compute_dtype)
        for n in _nodes(compiled)
        if (n.meta[AMP].aten or "").split(".")[0] in MATMULS
    ]
    assert len(matmuls) >= 8
    assert [name for name, dtype in matmuls if dtype != torch.float16] == []
    assert _rel(ours, reference) < 5e-3


# --- what capture saw is what the graph computes ---------------------------------------------


def _placed(gm: fx.GraphModule) -> set[str]:
    """The ops the cast placement raised after the capture (O2's free gathers), and their
    views: the model's Python read none of their dtypes (the placement's rule), so what it
    saw of them cannot have decided anything."""
    placed: set[str] = set()
    for node in gm.graph.nodes:
        amp = node.meta.get(AMP)
        source = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        views_placed = source is not None and source.name in placed and schema.is_view(node)
        if amp is not None and (amp.source == "placement" or views_placed):
            assert not node.meta.get(DTYPE_READ, False), node.name
            placed.add(node.name)
    return placed


def captured_vs_planned(compiled) -> list[str]:
    """Nodes whose dtype during capture (what the model's Python saw) differs from the
    dtype the rewritten graph computes for them (but for those the placement raised)."""
    gm = amp_graph.frontends.compiler.as_graph_module(compiled)
    planned = {n.name: n.meta[AMP] for n in gm.graph.nodes}
    placed = _placed(gm)
    found = []
    for node in gm.meta["amp_graph"].original.graph.nodes:
        value = node.meta.get("val")
        amp = planned.get(node.name)
        if node.op != "call_function" or not isinstance(value, torch.Tensor) or amp is None:
            continue
        if node.name in placed:
            continue
        source = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        given = source.meta.get("val") if source is not None else None
        if isinstance(given, torch.Tensor) and torch._C._is_alias_of(value, given):
            # the call returned its input (or a view of it): no kernel ran while capturing,
            # so none could be given the plan's dtype (torch 2.15's dropout(p=0); README)
            continue
        if value.is_floating_point() and amp.out_dtype != value.dtype:
            found.append(
                f"{node.name} ({amp.op}): captured {value.dtype}, computes {amp.out_dtype}"
            )
    return found


@pytest.mark.parametrize("policy", ["O1", "O2", "O3", "autocast"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_capture_sees_the_planned_dtypes_on_the_zoo(name: str, policy: str) -> None:
    make_model, make_inputs, _ = MODELS[name]
    torch.manual_seed(0)
    model, inputs = make_model(), make_inputs()
    compiled = amp_graph.compile(model, policy, torch.bfloat16, example_inputs=inputs)
    assert captured_vs_planned(compiled) == []


@pytest.mark.parametrize("policy", ["O1", "O2", "O3"])
@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "t5"])
def test_capture_sees_the_planned_dtypes_on_hf_models(name: str, policy: str) -> None:
    compiled = amp_graph.compile(Logits(_hf(name)), policy, torch.float16)
    compiled(_ids())
    assert captured_vs_planned(compiled) == []


class ReadsDtype(nn.Module):
    """GPT-2's eager attention in small: the probabilities are cast to ``v``'s dtype."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        probs = F.softmax(q @ k.transpose(-1, -2), dim=-1).type(v.dtype)
        return self.out((probs @ v).mean(1))


def test_pins_hold_the_same_through_compile_and_graph() -> None:
    torch.manual_seed(0)
    model = ReadsDtype()
    x, y = torch.randn(2, 5, 16), torch.tensor([0, 3])
    # a glob, as module paths inside a Graph start at the Graph ("model.qkv"; issue 18)
    policy = amp_graph.Policy.preset("O1").override(modules={"**qkv": "fp32"})

    compiled = amp_graph.compile(model, policy, torch.float16, example_inputs=(x,))
    graph = TrainGraph(model, torch.optim.SGD(model.parameters(), lr=0.0), policy=policy)
    graph(x, y)
    for gm in (amp_graph.frontends.compiler.as_graph_module(compiled), graph.build_graph):
        softmax_casts = [
            n.args[1]
            for n in gm.graph.nodes
            if n.meta[AMP].role is Role.USER_CAST and "softmax" in n.args[0].name
        ]  # the model's .type(v.dtype): v comes from the pinned qkv
        assert softmax_casts == [torch.float32], gm.code


class BranchesOnValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) if x.sum() > 0 else x


def test_a_failed_capture_leaves_no_mode_and_no_wrapper_behind() -> None:
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    model = BranchesOnValues()
    with pytest.raises(amp_graph.CaptureError):
        amp_graph.compile(model, "O2", example_inputs=(torch.randn(2, 4),))
    assert _get_current_function_mode_stack() == []
    assert _get_current_dispatch_mode_stack() == []
    assert "forward" not in vars(model)  # the capture's wrapper of forward is gone
    assert all(p.dtype == torch.float32 for p in model.parameters())  # O2's view undone


def _residual_add(gm: fx.GraphModule) -> fx.Node:
    """LlamaMLP's ``x + down(...)``: the last add of the graph."""
    adds = [n for n in gm.graph.nodes if n.op == "call_function" and "add" in str(n.target)]
    return adds[-1]


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("policy", ["O2", "O3"])
def test_a_cast_that_changes_nothing_at_capture_leaves_the_value_it_casts_alone(policy) -> None:
    """Llama's RMSNorm upcasts its input (``x.float()``), and the block adds ``x`` back.
    O2 and O3 cast the input to bf16 at entry, but it is float32 where the model is traced,
    so there ``x.float()`` returns ``x`` itself, and a tracer takes every later use of ``x``
    for the cast. The residual add must still read ``x`` (bf16, as Apex's O2 adds it), through
    compile, the torch.compile backend (dynamo traces in float32 too) and Graph, all alike."""
    from amp_graph.demo import models
    from amp_graph.frontends.dynamo_backend import backend, captured_graphs

    torch.manual_seed(0)
    model = models.LlamaMLP()
    x, y = torch.randn(2, 32), torch.tensor([0, 3])
    compiled = amp_graph.compile(model, policy, torch.bfloat16, example_inputs=(x,))
    dynamo = torch.compile(model, backend=backend(policy, torch.bfloat16, inner="eager"))
    out = dynamo(x)
    [backend_gm] = captured_graphs(dynamo)
    graph = TrainGraph(
        model, torch.optim.SGD(model.parameters(), lr=0.0), policy=policy, dtype=torch.bfloat16
    )
    graph(x, y)
    for gm in (
        amp_graph.frontends.compiler.as_graph_module(compiled),
        backend_gm,
        graph.build_graph,
    ):
        add = _residual_add(gm)
        assert add.meta[AMP].out_dtype == torch.bfloat16, gm.code
        read = [a for a in add.args if isinstance(a, fx.Node)]
        assert not any(a.meta[AMP].role is Role.USER_CAST for a in read), gm.code
        assert not any(n.target is torch.ops.aten.alias.default for n in gm.graph.nodes)
    # O2 and O3 return the output in float32, as Apex's do, through compile and the backend
    assert out.dtype == torch.float32 and torch.equal(out, compiled(x))


def test_which_tensor_method_casts_return_their_input_itself() -> None:
    """is_noop_cast must agree with torch: a cast it calls a no-op returns its input object,
    and one it does not returns a new tensor (or changes nothing of the dtype)."""
    from amp_graph.capture.casts import is_noop_cast

    x, low = torch.randn(2), torch.randn(2, dtype=torch.bfloat16)
    calls = [
        ("float", (x,), {}),
        ("half", (x,), {}),
        ("bfloat16", (low,), {}),
        ("double", (x,), {}),
        ("to", (x, torch.float32), {}),
        ("to", (x, torch.bfloat16), {}),
        ("to", (x,), {"dtype": torch.float32}),
        ("to", (x, torch.float32), {"copy": True}),
        ("to", (x, x), {}),
        ("to", (x, low), {}),
        ("to", (x, "cpu"), {}),  # no dtype: nothing to keep apart
        ("type", (x, torch.float32), {}),
        ("type_as", (x, x), {}),
        ("type_as", (x, low), {}),
    ]
    for name, args, kwargs in calls:
        result = getattr(torch.Tensor, name)(*args, **kwargs)
        # torch returns the input itself for each of these; a device-only .to() is left out
        expected = result is args[0] and args[1:] != ("cpu",)
        assert is_noop_cast(name, args, kwargs) is expected, (name, args, kwargs)
        assert is_noop_cast(getattr(torch.Tensor, name), args, kwargs) is expected
    assert not is_noop_cast(torch.add, (x, x), {})
    assert not is_noop_cast(lambda: None, (), {})
