"""Caches whose steps one graph cannot hold decode under torch.autocast for the whole
generation (amp_graph/frontends/cached_decode.py): a sliding window counts tokens in Python,
which its prefill already shows, so the prefill runs under torch.autocast too and no graph
writes the cache the eager steps then write. torch.autocast's generate is the oracle."""

from __future__ import annotations

import logging

import pytest
import torch

import amp_graph

transformers = pytest.importorskip("transformers")

BF16 = torch.bfloat16
TINY = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    vocab_size=100,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=None,
)
GENERATE = dict(max_new_tokens=8, do_sample=False, output_scores=True, return_dict_in_generate=True)


def _mistral() -> transformers.MistralForCausalLM:
    torch.manual_seed(0)
    return transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=4, **TINY))


def _gemma2() -> transformers.Gemma2ForCausalLM:
    """Gemma-2 alternates sliding-window and full-attention layers."""
    config = transformers.Gemma2Config(sliding_window=4, head_dim=8, **TINY)
    torch.manual_seed(0)
    return transformers.Gemma2ForCausalLM(config)


def _llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))


def _prompt() -> torch.Tensor:
    return torch.randint(2, 100, (2, 7), generator=torch.Generator().manual_seed(1))


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("amp_graph")]


@pytest.mark.parametrize(
    "family, cache, policy",
    [
        (_mistral, "static", "O2"),
        (_gemma2, "static", "O3"),
        (_mistral, "dynamic", "O2"),
        (_gemma2, "dynamic", "O2"),
    ],
    ids=["mistral-static-O2", "gemma2-static-O3", "mistral-dynamic-O2", "gemma2-dynamic-O2"],
)
def test_a_sliding_window_generates_as_torch_autocast_from_its_prefill(
    family, cache, policy, caplog
):
    """The prefill graph used to write O2's bf16 keys, then the refused steps wrote
    torch.autocast's float32 ones: a static cache's index_copy_ raised, a dynamic cache's cat
    made the cache float32 mid-generate. Now the whole generate is torch.autocast's, bit for
    bit, said once at WARNING, and no graph is captured."""
    model = family().eval()
    prompt = _prompt()
    options = dict(GENERATE, cache_implementation=cache) if cache == "static" else GENERATE
    with torch.no_grad(), torch.autocast("cpu", BF16):
        expected = model.generate(prompt, **options)
    compiled = amp_graph.compile(model, policy, BF16)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="amp_graph"):
        got = compiled.generate(prompt, **options)
    assert torch.equal(got.sequences, expected.sequences)
    for ours, theirs in zip(got.scores, expected.scores, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    [warning] = _warnings(caplog)
    assert "SlidingWindowLayer (layer 0 of the" in warning and "cumulative_length" in warning
    assert f"policy {policy}" in warning
    assert not compiled.decoder.graph_modules


class LateCountingLayer(transformers.cache_utils.DynamicLayer):
    """A layer whose Python state stays put at its first fill and changes at every write
    after it: the prefill is a graph, the refusal comes at the first step."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0

    def update(self, keys: torch.Tensor, values: torch.Tensor, *args, **kwargs):
        if self.is_initialized:
            self.steps += 1
        return super().update(keys, values, *args, **kwargs)


def test_steps_refused_after_a_prefill_graph_keep_the_dtype_the_graph_wrote(caplog):
    """O2's prefill graph stores bf16 keys; the refused steps' torch.autocast computes
    float32 ones (RoPE's product with float32 cos): stored as they are, a dynamic layer's
    cat would make the whole cache float32, silently. Each eager write keeps the cache's
    dtypes: one WARNING, and the tokens are torch.autocast's."""
    model = _llama().eval()
    prompt = _prompt()
    with torch.no_grad(), torch.autocast("cpu", BF16):
        expected = model.generate(prompt, max_new_tokens=8, do_sample=False)
    compiled = amp_graph.compile(model, "O2", BF16)
    cache = transformers.DynamicCache()
    cache.layers = [LateCountingLayer() for _ in range(2)]
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="amp_graph"):
        got = compiled.generate(prompt, max_new_tokens=8, do_sample=False, past_key_values=cache)
    assert [layer.steps for layer in cache.layers] == [7, 7]  # 8 tokens: a prefill, 7 steps
    assert {(layer.keys.dtype, layer.values.dtype) for layer in cache.layers} == {(BF16, BF16)}
    assert cache.get_seq_length() == 7 + 7
    assert "update" not in vars(cache.layers[0])  # the wrapped update is gone
    [warning] = _warnings(caplog)
    assert "LateCountingLayer (layer 0 of the DynamicCache) changes its Python state steps" in (
        warning
    )
    assert len(compiled.decoder.graph_modules) == 1  # the prefill's
    assert torch.equal(got, expected)
