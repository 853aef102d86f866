"""A plan never asks the CPU for a low-precision kernel it lacks
(amp_graph.frontends.cpu_low_kernels).

On an AVX2-only CPU, oneDNN has no bfloat16 LSTM: ``nn.LSTM`` in bfloat16 raises at its first
call, under torch.autocast too. Here the probes are real (whatever this CPU has) and, to see
the AVX2 behaviour on any CPU, a probe is replaced by one that raises as such a CPU does. The
whole suite runs as an AVX2 CPU plans with ``pytest --without-cpu-kernel=lstm,gru,...``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
import zoo
from amp_graph.passes import AMP
from test_front_end import tokens

import amp_graph
from amp_graph.frontends import cpu_low_kernels as cpu_kernels
from amp_graph.frontends.policy_request import resolve
from amp_graph.policy import OpFacts, Policy, Rule

BF16, FP32 = torch.bfloat16, torch.float32
ONEDNN = "could not create a primitive descriptor for the LSTM forward propagation primitive"


@pytest.fixture
def no_bf16_lstm(monkeypatch: pytest.MonkeyPatch):
    """This CPU as an AVX2-only one: the LSTM probe raises oneDNN's error in low dtypes."""

    def probe(dtype: torch.dtype) -> None:
        raise RuntimeError(f"{ONEDNN}\nmore lines of oneDNN's message")

    monkeypatch.setitem(cpu_kernels.PROBES, "lstm", probe)
    cpu_kernels.reprobe()
    yield
    cpu_kernels.reprobe()  # monkeypatch restores the real probe after this


def _lstm_nodes(compiled) -> list:
    gm = amp_graph.frontends.compiler.as_graph_module(compiled)
    return [n for n in gm.graph.nodes if n.op == "call_function" and "lstm" in str(n.target)]


@pytest.mark.parametrize("op", sorted(cpu_kernels.PROBES))
def test_the_probes_say_what_this_cpu_runs(op: str) -> None:
    """On every CPU kind: an op is reported missing exactly where calling it raises."""
    cpu_kernels.reprobe()
    for dtype in (BF16, torch.float16):
        try:
            cpu_kernels.PROBES[op](dtype)
            runs = True
        except RuntimeError:
            runs = False
        assert (op not in cpu_kernels.missing_low_kernels(dtype)) == runs, (op, dtype)
    assert cpu_kernels.missing_low_kernels(FP32) == {}


def test_the_reason_is_the_first_line_of_torchs_error_with_the_cpu(no_bf16_lstm) -> None:
    why = cpu_kernels.missing_low_kernels(BF16)["lstm"]
    assert why.endswith(ONEDNN) and "more lines" not in why
    assert why.startswith(cpu_kernels.cpu_name())


def test_a_missing_kernel_outranks_tables_and_overrides_and_moves_nothing_else() -> None:
    lstm = OpFacts("lstm", "aten.lstm", (), ("lstm.input",), ("",), (nn.Module,))
    softmax = OpFacts("softmax", "aten.softmax", (), ("softmax.int",), ("",), (nn.Module,))
    overridden = Policy.preset("O2").override(ops={"lstm": "allow"})
    limited = dataclasses.replace(overridden, missing_kernels={"lstm": "AVX2: no kernel"})
    decision = limited.decide(lstm)
    assert decision.rule is Rule.DENY and decision.source == "cpu"
    assert "AVX2: no kernel" in decision.detail and "op override" in decision.detail
    assert limited.decide(softmax) == overridden.decide(softmax)  # other ops: as before


def test_only_cpu_models_learn_the_cpus_limits(no_bf16_lstm) -> None:
    missing = cpu_kernels.missing_low_kernels(BF16)
    assert "lstm" in missing
    assert dict(resolve("O1", BF16, "cpu").policy.missing_kernels) == missing
    assert dict(resolve("O1", torch.float16, "cuda").policy.missing_kernels) == {}


def _lstm_model() -> tuple[nn.Module, tuple]:
    model = zoo.RNNModel("LSTM")
    return model, (tokens(7, 3, 40), model.init_hidden(3))


def test_an_lstm_runs_in_float32_on_a_cpu_without_the_kernel(no_bf16_lstm) -> None:
    """The AVX2 laptop: the plan runs the LSTM in float32 (its inputs cast up), says so in a
    warning and in explain, and the first step runs, forward and backward."""
    model, inputs = _lstm_model()
    with pytest.warns(UserWarning, match=r"no low-precision kernel for lstm \(lstm\.input\)"):
        compiled = amp_graph.compile(model, "O1", BF16, example_inputs=inputs)
    (lstm,) = _lstm_nodes(compiled)
    amp = lstm.meta[AMP]
    assert (amp.rule, amp.source, amp.compute_dtype) == (Rule.DENY, "cpu", FP32)
    assert ONEDNN in amp_graph.explain(compiled, lstm.name)
    out, (h, c) = compiled(*inputs)
    assert h.dtype == c.dtype == FP32
    out.float().logsumexp(-1).mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    # the decoder still computes in bfloat16: only the op the CPU lacks moved
    gm = amp_graph.frontends.compiler.as_graph_module(compiled)
    linears = [n.meta[AMP].compute_dtype for n in gm.graph.nodes if "linear" in str(n.target)]
    assert linears == [BF16]
    record = amp_graph.frontends.compiler.as_graph_module(compiled).meta["amp_graph"]
    assert record.stats["cpu_float32_fallbacks"] == 1


def test_the_backend_and_graph_plan_the_same_fallback(no_bf16_lstm, fresh_dynamo) -> None:
    model, (data, hidden) = _lstm_model()
    backend = amp_graph.backend("O1", BF16, inner="eager")
    # without allow_rnn, dynamo runs nn.LSTM eagerly, outside every graph
    with (
        torch._dynamo.config.patch(allow_rnn=True),
        pytest.warns(UserWarning, match="no low-precision kernel for lstm"),
    ):
        _, (h, c) = torch.compile(model, backend=backend)(data, hidden)
    assert (h.dtype, c.dtype) == (FP32, FP32)
    (graph,) = backend._graphs
    (lstm,) = _lstm_nodes(graph)
    assert (lstm.meta[AMP].source, lstm.meta[AMP].compute_dtype) == ("cpu", FP32)

    class Eval(amp_graph.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.config.enable_amp(True, policy="O1", dtype=BF16)

        def build(self, data, hidden):
            return self.model(data, hidden)

    with pytest.warns(UserWarning, match="no low-precision kernel for lstm"):
        _, (h, c) = Eval()(data, hidden)
    assert (h.dtype, c.dtype) == (FP32, FP32)


def test_without_the_limit_the_lstm_is_low() -> None:
    """The same model on a CPU that has the kernel (the real probes here say so, or the test
    says which CPU lacks it): the LSTM computes in bfloat16."""
    cpu_kernels.reprobe()
    if "lstm" in cpu_kernels.missing_low_kernels(BF16):
        pytest.skip(f"this CPU has no bf16 LSTM: {cpu_kernels.missing_low_kernels(BF16)['lstm']}")
    model, inputs = _lstm_model()
    compiled = amp_graph.compile(model, "O1", BF16, example_inputs=inputs)
    (lstm,) = _lstm_nodes(compiled)
    assert lstm.meta[AMP].compute_dtype == BF16
