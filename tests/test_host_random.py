"""Random numbers a model's Python draws on the host (Python's ``random``, numpy's global
generator) are drawn once at capture, and one graph would replay them on every call: every
entry point that captures one graph refuses such a forward, naming the generator and the ways
out; a forward that seeds its generator itself (HF BigBird) is faithful to one graph and is
captured; the torch.compile backend draws anew on each call.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn as nn
from graph_helpers import TrainGraph

import amp_graph
from amp_graph.capture import CaptureError
from amp_graph.capture.host_random import HostGenerators

BF16 = torch.bfloat16


class LayerDrop(nn.Module):
    """fairseq-style LayerDrop: each layer skipped with probability p, drawn in Python."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        self.p = p
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training and random.random() < self.p:
                continue
            x = torch.relu(layer(x))
        return self.head(x)


class NumpyMask(nn.Module):
    """SpecAugment in small: time steps masked where numpy's global generator says."""

    def __init__(self, in_eval_too: bool = False) -> None:
        super().__init__()
        self.in_eval_too = in_eval_too
        self.proj = nn.Linear(8, 8)
        self.masked = nn.Parameter(torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if self.training or self.in_eval_too:
            mask = torch.from_numpy(np.random.rand(*h.shape[:2]) < 0.5)
            h = torch.where(mask[..., None], self.masked.to(h.dtype), h)
        return h.sum(-1)


class SeedsItself(nn.Module):
    """HF BigBird's way: numpy seeded with the layer's index before each draw, so every call
    draws the same numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            np.random.seed(index)
            keep = torch.from_numpy(np.random.rand(x.shape[-1]) < 0.7).to(x.dtype)
            x = layer(x) * keep
        return x


def _model(cls: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return cls().train()


def test_python_random_in_the_forward_is_refused_by_compile():
    compiled = amp_graph.compile(_model(LayerDrop), "O1", BF16)
    with pytest.raises(CaptureError) as raised:
        compiled(torch.randn(4, 8))
    text = str(raised.value)
    assert "LayerDrop" in text and "Python's random" in text and "numpy" not in text.split("(")[0]
    assert "backend='amp_graph'" in text and "torch.rand" in text


def test_the_same_model_in_eval_mode_draws_nothing_and_compiles():
    model = _model(LayerDrop).eval()
    compiled = amp_graph.compile(model, "O1", BF16)
    x = torch.randn(4, 8)
    with torch.autocast("cpu", BF16):
        expected = model(x)
    assert torch.equal(compiled(x), expected)


def test_numpy_draws_are_refused_and_the_generators_left_as_the_forward_leaves_them():
    model = _model(NumpyMask)
    x = torch.randn(2, 6, 8)
    np.random.seed(3)
    random.seed(3)
    model(x)  # eager: where one forward leaves the generators
    after_eager = HostGenerators.now()
    np.random.seed(3)
    random.seed(3)
    with pytest.raises(CaptureError, match=r"numpy\.random \(its global generator\)"):
        amp_graph.compile(model, "O1", BF16)(x)
    assert not after_eager.moved(HostGenerators.now())


def test_graph_and_export_refuse_it_too():
    model = _model(LayerDrop)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    graph = TrainGraph(model, optimizer, dtype=BF16)
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CaptureError, match="Python's random"):
        graph(torch.randn(4, 8), torch.randint(0, 3, (4,)))
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters(), strict=True))
    # export makes an inference program (eval mode): a forward drawing there is refused too
    torch.manual_seed(0)
    drawing_in_eval = NumpyMask(in_eval_too=True)
    with pytest.raises(CaptureError, match=r"numpy\.random"):
        amp_graph.export(drawing_in_eval, (torch.randn(2, 6, 8),), policy="O1", dtype=BF16)


def test_a_forward_that_seeds_its_generator_is_captured_and_matches_eager():
    model = _model(SeedsItself)
    x = torch.randn(4, 8)
    np.random.seed(11)
    compiled = amp_graph.compile(model, "O1", BF16)
    ours = [compiled(x) for _ in range(3)]
    state_after_ours = HostGenerators.now()
    np.random.seed(11)
    with torch.autocast("cpu", BF16):
        theirs = [model(x) for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    # the generator stands where eager's forwards leave it (the second capture is undone)
    assert not state_after_ours.moved(HostGenerators.now())


def test_a_failing_capture_that_drew_says_so_beside_the_failure():
    class MaskThenBranch(NumpyMask):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = super().forward(x)
            if out.sum() > 0:  # data-dependent: one graph cannot express it
                return out
            return -out

    with pytest.raises(CaptureError) as raised:
        amp_graph.compile(_model(MaskThenBranch), "O1", BF16)(torch.randn(2, 6, 8))
    text = str(raised.value)
    assert "branches on the values inside a tensor" in text
    assert "Also: amp_graph cannot capture MaskThenBranch" in text and "numpy.random" in text


def test_the_backend_draws_anew_on_each_call(fresh_dynamo):
    model = _model(LayerDrop)
    compiled = torch.compile(model, backend="amp_graph")
    x = torch.randn(4, 8)
    random.seed(0)
    outs = [compiled(x) for _ in range(8)]
    assert len({tuple(o.flatten().tolist()) for o in outs}) > 1


def test_hf_wav2vec2_spec_augment_refused_and_masks_passed_in_are_inputs():
    transformers = pytest.importorskip("transformers")
    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        vocab_size=20, conv_dim=(16, 16), conv_kernel=(10, 3), conv_stride=(5, 2),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, layerdrop=0.0,
        mask_time_prob=0.2, mask_time_length=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Wav2Vec2ForCTC(config).train()
    audio = torch.randn(2, 400)
    with pytest.raises(CaptureError, match=r"numpy\.random.*mask_time_indices="):
        amp_graph.compile(model, "O1", BF16)(input_values=audio)

    # the way out the message names: masks drawn outside, passed in as an input
    compiled = amp_graph.compile(model, "O1", BF16)
    frames = model.wav2vec2._get_feat_extract_output_lengths(audio.shape[1])
    masks = [torch.zeros(2, int(frames), dtype=torch.bool) for _ in range(2)]
    masks[1][:, 3:9] = True
    logits = []
    for mask in masks:
        torch.manual_seed(1)  # the same dropout bits for both calls
        logits.append(compiled(input_values=audio, mask_time_indices=mask).logits)
    assert not torch.equal(logits[0], logits[1])
    torch.manual_seed(1)
    again = compiled(input_values=audio, mask_time_indices=masks[0]).logits
    assert torch.equal(again, logits[0])
