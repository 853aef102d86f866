"""The model's own methods reached through ``amp_graph.compile``'s wrapper run its graph.

``compiled.predict(x)`` where ``predict`` calls ``self(x)``: the wrapper hands out the
model's bound method, whose ``self`` is the model, not the wrapper. It ran the model's own
forward, in float32, without a word; only ``generate`` was routed through the graph."""

from __future__ import annotations

import torch
import torch.nn as nn

import amp_graph


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).softmax(-1)

    def predict_by_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x).softmax(-1)

    def predict_twice(self, x: torch.Tensor) -> torch.Tensor:
        return self.predict(x) + self.predict(x)

    @staticmethod
    def classes() -> int:
        return 4


def _classifier_input_and_autocast_prediction() -> tuple[Classifier, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = Classifier()
    x = torch.randn(5, 8)
    with torch.autocast("cpu", torch.bfloat16):
        expected = model.predict(x)
    return model, x, expected


def test_methods_calling_the_model_run_its_graph_as_under_autocast() -> None:
    model, x, expected = _classifier_input_and_autocast_prediction()
    in_float32 = model.predict(x)
    compiled = amp_graph.compile(model, "autocast", torch.bfloat16)
    for method in ("predict", "predict_by_forward"):
        got = getattr(compiled, method)(x)
        assert got.dtype == expected.dtype == torch.bfloat16, method
        assert torch.equal(got, expected), method
        assert not torch.equal(got.float(), in_float32), method
    assert torch.equal(compiled.predict_twice(x), expected + expected)
    assert len(compiled.graph_modules) == 1  # one capture served every method
    assert "forward" not in model.__dict__  # the model is as it was
    assert compiled.classes() == 4  # not a method of the instance: handed out as it is
    assert compiled.predict.__wrapped__ == model.predict


def test_a_method_of_a_compiled_in_place_model_is_its_own() -> None:
    """compile_ sets the forward on the instance: the model's methods run the graph already."""
    model, x, expected = _classifier_input_and_autocast_prediction()
    amp_graph.compile_(model, "autocast", torch.bfloat16)
    assert torch.equal(model.predict(x), expected)


class Autoencoder(nn.Module):
    """diffusers' AutoencoderKL's shape: ``decode`` calls the decoder, never ``self``."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.decoder = nn.Linear(8, 4), nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(z)

    def decoder_weight(self) -> torch.Tensor:
        return self.decoder.weight


def test_a_method_that_never_calls_the_model_says_it_ran_uncompiled(caplog) -> None:
    model = Autoencoder()
    compiled = amp_graph.compile(model, "O1", torch.bfloat16)
    z = torch.randn(2, 4)
    with caplog.at_level("WARNING", logger="amp_graph"):
        out = compiled.decode(z)
        compiled.decode(z)  # said once
        compiled.decoder_weight()  # a getter: nothing computed, nothing said
        compiled(torch.randn(2, 8))
    assert torch.equal(out, model.decoder(z)) and out.dtype == torch.float32  # what it did
    said = [r.getMessage() for r in caplog.records if "ran uncompiled" in r.getMessage()]
    assert len(said) == 1 and "Autoencoder.decode" in said[0]
    assert "amp_graph.compile_(model.<submodule>" in said[0]


def test_a_method_that_calls_the_model_says_nothing(caplog) -> None:
    model, x, _ = _classifier_input_and_autocast_prediction()
    compiled = amp_graph.compile(model, "O1", torch.bfloat16)
    with caplog.at_level("WARNING", logger="amp_graph"):
        compiled.predict(x)
    assert not [r for r in caplog.records if "ran uncompiled" in r.getMessage()]
