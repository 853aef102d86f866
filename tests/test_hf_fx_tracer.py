"""GraphModules from HF's own fx tracer (``transformers.utils.fx.symbolic_trace``) compile as
the models they were traced from.

* GPT-2 and BERT, traced, get the plan their untraced models get (op, role, compute and out
  dtype, node by node), bit-identical outputs and gradients, and the traced GraphModule is
  left as it was.
* A module override (by path or by type) of BERT's attention, which the tracer inlines, pins
  the same ops in the trace as in the model: the capture carries the tracer's module stacks.
* GPT-2, BERT and T5, traced, under ``policy="autocast"`` give the outputs of the traced
  GraphModule run under ``torch.autocast("cpu")``, bit for bit. T5 is held to that oracle only:
  its trace is another program under mixed precision (``scores += position_bias`` becomes
  ``scores + position_bias``, which promotes bfloat16 scores to float32), so neither
  torch.autocast nor amp_graph gives it the model's numbers.

transformers 5 removed the tracer. To run this file, lay transformers 4.x over this venv:

    python3 -m venv /tmp/hfvenv
    echo "import site; site.addsitedir('$PWD/.venv/lib/python3.11/site-packages')" \\
        > /tmp/hfvenv/lib/python3.11/site-packages/main_venv.pth
    /tmp/hfvenv/bin/pip install --no-deps transformers==4.46.3 "tokenizers>=0.20,<0.21" \\
        "huggingface_hub<1.0" requests urllib3 idna certifi charset_normalizer
    /tmp/hfvenv/bin/python -m pytest tests/test_hf_fx_tracer.py

(transformers 4.57 also has the tracer, but it cannot trace GPT-2 under torch >= 2.6: its
causal mask is built with ``torch.vmap``, which takes no fx proxies; that case then skips.)
"""

from __future__ import annotations

import pytest
import torch
from oracles import assert_bitwise_cpu_autocast
from test_one_ir import _plan

import amp_graph

hf_fx = pytest.importorskip(
    "transformers.utils.fx",
    reason="transformers 5 removed HF's fx tracer; run with transformers 4.x "
    "(see this file's docstring for the venv)",
)
import transformers  # noqa: E402

BF16 = torch.bfloat16
VOCAB, SEQ = 64, 8


def _gpt2() -> torch.nn.Module:
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2, use_cache=False
        )
    )


def _bert() -> torch.nn.Module:
    return transformers.BertForMaskedLM(
        transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=16,
        )
    )  # fmt: skip


def _t5() -> torch.nn.Module:
    return transformers.T5ForConditionalGeneration(
        transformers.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
            use_cache=False,
        )
    )  # fmt: skip


CASES = {
    "gpt2": (_gpt2, ["input_ids", "attention_mask"]),
    "bert": (_bert, ["input_ids", "attention_mask"]),
    "t5": (_t5, ["input_ids", "attention_mask", "decoder_input_ids"]),
}


def _case(name: str) -> tuple[torch.nn.Module, torch.fx.GraphModule, dict[str, torch.Tensor]]:
    """A random model in eval mode, its HF trace, and keyword inputs both take."""
    build, input_names = CASES[name]
    model = build().eval()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    values = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "decoder_input_ids": ids}
    try:
        traced = hf_fx.symbolic_trace(model, input_names=input_names)
    except Exception as error:  # the tracer's own limits; amp_graph has not run yet
        pytest.skip(f"transformers {transformers.__version__} cannot trace {name}: {error}")
    return model, traced, {k: values[k] for k in input_names}


def _same_decision(traced: tuple, direct: tuple) -> bool:
    """One node of each plan. fx proxies have no in-place operators, so the trace records
    ``x += y`` as ``x + y``: ``aten.add_`` (role inplace, never cast, so no compute dtype) in
    the model's plan is ``aten.add`` there, the same decision when the out dtypes agree. For
    the same reason a cast of that value may be recomputed in backward in the trace (an
    ``aten.add`` result nothing writes) and kept in the model (recompute_casts never decides
    a cast of a value the graph writes): the same dtypes, a different memory decision."""
    if direct[1] == "inplace" and traced[1] == "op":
        return traced[0] == direct[0].replace("_.", ".") and traced[3] == direct[3]
    if traced[1] == direct[1] == "cast":
        return traced[2:] == direct[2:]
    return traced == direct


@pytest.mark.parametrize(("name", "policy"), [("gpt2", "O1"), ("bert", "O1"), ("bert", "O2")])
def test_an_hf_traced_model_compiles_as_the_model(name: str, policy: str) -> None:
    model, traced, inputs = _case(name)
    code = traced.code
    direct = amp_graph.compile(model, policy, BF16, example_kwargs=inputs)
    via_trace = amp_graph.compile(traced, policy, BF16, example_kwargs=inputs)
    plan_traced, plan_direct = _plan(via_trace.graph_module), _plan(direct.graph_module)
    assert len(plan_traced) == len(plan_direct)
    pairs = zip(plan_traced, plan_direct, strict=True)
    differ = [(t, d) for t, d in pairs if not _same_decision(t, d)]
    assert not differ, differ
    assert traced.code == code, "the user's GraphModule was changed"

    out_direct, out_traced = direct(**inputs)["logits"], via_trace(**inputs)["logits"]
    # O2 returns the logits in float32, as Apex's O2 does (Policy.output_dtype)
    assert out_traced.dtype == out_direct.dtype == (torch.float32 if policy == "O2" else BF16)
    assert torch.equal(out_traced, out_direct)
    out_traced.float().square().mean().backward()
    # HF's tracer shares the model's parameters (tied ones may go by another name there)
    traced_grads = {id(p): p.grad.clone() for p in traced.parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    out_direct.float().square().mean().backward()
    model_grads = {id(p): (k, p.grad) for k, p in model.named_parameters() if p.grad is not None}
    assert traced_grads.keys() == model_grads.keys()
    for key, (parameter, grad) in model_grads.items():
        assert torch.equal(traced_grads[key], grad), parameter


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_hf_traced_model_matches_cpu_autocast(name: str) -> None:
    _, traced, inputs = _case(name)
    assert_bitwise_cpu_autocast(traced, (), inputs)


@pytest.mark.parametrize("by", ["module path", "module type"])
def test_module_overrides_reach_the_ops_hfs_tracer_inlined(by: str) -> None:
    """HF's tracer inlines attention's forward; its nodes keep the tracer's module stack, so
    an override of the attention module pins its matmuls in the trace as in the model."""
    model, traced, inputs = _case("bert")
    attention = transformers.models.bert.modeling_bert.BertSelfAttention
    override = (
        {"modules": {"bert.encoder.layer.0.attention.self": "fp32"}}
        if by == "module path"
        else {"module_types": {attention: "fp32"}}
    )
    policy = amp_graph.Policy.preset("O1").override(**override)

    def pinned(compiled) -> list[str]:
        return sorted(
            str(n.target)
            for n in compiled.graph_module.graph.nodes
            if n.op == "call_function" and n.meta["amp"].source.startswith("module")
        )

    direct = amp_graph.compile(model, policy, BF16, example_kwargs=inputs)
    via_trace = amp_graph.compile(traced, policy, BF16, example_kwargs=inputs)
    assert any("matmul" in t or "scaled_dot" in t or "bmm" in t for t in pinned(direct))
    assert pinned(via_trace) == pinned(direct)
    assert torch.equal(via_trace(**inputs)["logits"], direct(**inputs)["logits"])
