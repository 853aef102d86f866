"""An LSTM language model as PyTorch's word_language_model example writes it, compiled.

Two things its training loop does that a capture must take: the last batch of an epoch is
shorter (the corpus does not divide by the BPTT length), and under ``mode="default"``
(inductor, the CUDA default) the graph reads the ``nn.LSTM``'s weights, which dynamo
refuses to trace through unless told (``allow_rnn``). torch.autocast in eager mode is the
oracle (policy ``"autocast"``: its lists; LSTM in bf16 where the CPU has the kernel).
"""

from __future__ import annotations

import copy

import torch
import zoo
from test_front_end import tokens

import amp_graph
from amp_graph.frontends.compile_modes import RnnAllowed

BF16 = torch.bfloat16


def _step(model, data, hidden):
    output, hidden = model(data, hidden)
    output.float().sum().backward()
    return output, zoo.repackage_hidden(hidden)


def test_an_lstm_language_model_takes_the_shorter_last_batch_as_torch_autocast_does():
    torch.manual_seed(0)
    model = zoo.RNNModel("LSTM")
    reference = copy.deepcopy(model)
    compiled = amp_graph.compile(model, "autocast", BF16)
    for length in (12, 12, 7):  # bptt 12, then what the corpus leaves
        data = tokens(length, 3, 40)
        got, _ = _step(compiled, data, model.init_hidden(3))
        with torch.autocast("cpu", BF16):
            want, _ = _step(reference, data, reference.init_hidden(3))
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=5e-2, atol=5e-2)


def test_inductor_compiles_a_graph_that_reads_an_lstms_weights(fresh_dynamo):
    torch.manual_seed(0)
    model = zoo.RNNModel("LSTM")
    eager_model = copy.deepcopy(model)
    inductor = amp_graph.compile(model, "O1", BF16, mode="default")
    eager = amp_graph.compile(eager_model, "O1", BF16, mode="eager")
    data = tokens(12, 3, 40)
    got, _ = _step(inductor, data, model.init_hidden(3))
    want, _ = _step(eager, data, eager_model.init_hidden(3))
    assert isinstance(next(iter(inductor._inductor._compiled.values())), RnnAllowed)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    for mine, theirs in zip(model.parameters(), eager_model.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=5e-2, atol=5e-2)
