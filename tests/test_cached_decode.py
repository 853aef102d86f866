"""Decoding with a KV cache as graphs (amp_graph/frontends/cached_decode.py): the cache's
tensors are a graph's inputs and outputs, so every op of the prefill and of each step gets
the policy's dtype, whatever the policy; torch.autocast is the oracle where the policy is
its lists. A cache whose step one graph cannot hold decodes under torch.autocast, said once
at WARNING with the reason."""

from __future__ import annotations

import logging
import warnings
from collections import Counter

import pytest
import torch
from amp_graph.passes import AMP
from amp_graph.passes.classify import normalize_module_path
from hf_configs import small_gpt2_config, small_llama_config

import amp_graph
from amp_graph.capture import CaptureError, capture_module
from amp_graph.frontends.cached_decode import cache_layout

transformers = pytest.importorskip("transformers")

VOCAB = 100
BF16 = torch.bfloat16
# the ops whose dtype a policy decides and a decode step runs: products, norms, attention
DECIDED = {"addmm", "mm", "linear", "bmm", "layer_norm", "scaled_dot_product_attention"}


def _gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(small_gpt2_config(VOCAB)).eval()


def _llama() -> transformers.LlamaForCausalLM:
    config = small_llama_config()  # vocabulary VOCAB
    config.bos_token_id = config.eos_token_id = config.pad_token_id = 0
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _prompt(batch: int = 2, length: int = 4) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1))


GENERATE = dict(
    max_new_tokens=6,
    do_sample=False,
    use_cache=True,
    output_scores=True,
    return_dict_in_generate=True,
)


def _decisions(gm: torch.fx.GraphModule) -> Counter:
    """(innermost module path, op, dtype) of every decided op of ``gm``."""
    found: Counter = Counter()
    for node in gm.graph.nodes:
        name = getattr(node.target, "__name__", "").split(".")[0]
        if node.op != "call_function" or name not in DECIDED:
            continue
        stack = node.meta.get("nn_module_stack") or {}
        path = normalize_module_path(str(list(stack.values())[-1][0])) if stack else ""
        found[(path, name, node.meta[AMP].out_dtype)] += 1
    return found


@pytest.mark.parametrize("family", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_generate_under_the_autocast_policy_is_bitwise_torch_autocast(family):
    model = family()
    prompt = _prompt()
    with torch.autocast("cpu", BF16):
        expected = model.generate(prompt, **GENERATE)
    amp_graph.compile_(model, "autocast", BF16)
    got = model.generate(prompt, **GENERATE)
    assert torch.equal(got.sequences, expected.sequences)
    for ours, theirs in zip(got.scores, expected.scores, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert len(model.forward.compiled.decoder.graph_modules) == 2


@pytest.mark.parametrize(
    "policy",
    ["O1", "O2", "O3", amp_graph.Policy.preset("O1").override(modules={"transformer.h.1": "fp32"})],
    ids=["O1", "O2", "O3", "O1-block-fp32"],
)
def test_each_decode_step_computes_at_the_dtypes_the_policy_gives_the_forward(policy):
    """The decode graph's products, norms and attention have the forward graph's dtypes,
    module by module (O3's norms low, an fp32 block's products float32), which
    torch.autocast's lists alone would not give."""
    model = _gpt2()
    prompt = _prompt()
    compiled = amp_graph.compile(model, policy, BF16)
    forward = _decisions(compiled.capture(input_ids=prompt))
    compiled.generate(prompt, **GENERATE)
    prefill, step = compiled.decoder.graph_modules
    for gm in (prefill, step):
        assert set(_decisions(gm)) == set(forward)
    dtypes = {(path, op): dtype for path, op, dtype in forward}
    name = policy if isinstance(policy, str) else "block-fp32"
    assert dtypes[("transformer.h.0.mlp.c_fc", "addmm")] is BF16
    assert dtypes[("transformer.h.0.ln_1", "layer_norm")] is (
        BF16 if name == "O3" else torch.float32
    )
    if name == "block-fp32":
        assert dtypes[("transformer.h.1.mlp.c_fc", "addmm")] is torch.float32


class CountingLayer(transformers.cache_utils.DynamicLayer):
    """A cache layer whose Python state changes at every step (as a sliding window's
    counter does): one graph would bake it."""

    def __init__(self) -> None:
        super().__init__()
        self.updates = 0

    def update(self, keys: torch.Tensor, values: torch.Tensor, *args, **kwargs):
        self.updates += 1
        return super().update(keys, values, *args, **kwargs)


def _counting_cache(layers: int = 2) -> transformers.DynamicCache:
    cache = transformers.DynamicCache()
    cache.layers = [CountingLayer() for _ in range(layers)]
    return cache


def test_a_cache_whose_python_state_changes_each_step_decodes_under_autocast_warning_once(
    caplog,
):
    """The prefill already changes the layers' counter, which every step would change
    again: the prefill and the steps alike run the class's forward under torch.autocast, so
    no graph writes the cache."""
    model = _gpt2()
    prompt = _prompt()
    steps = [prompt, prompt[:, :1], prompt[:, 1:2]]
    amp_graph.compile_(model, "O1", BF16)

    def run(prefill, decode) -> list[torch.Tensor]:
        cache = _counting_cache()
        logits = [prefill(input_ids=steps[0], cache=cache, use_cache=True).logits]
        logits += [decode(input_ids=ids, cache=cache, use_cache=True).logits for ids in steps[1:]]
        assert [layer.updates for layer in cache.layers] == [3, 3]  # the counter kept counting
        return logits

    def autocast_eager(**kwargs):
        with torch.autocast("cpu", BF16):
            return type(model).forward(model, **kwargs)

    with caplog.at_level(logging.WARNING, logger="amp_graph"):
        got = run(model, model)
        run(model, model)
    expected = run(autocast_eager, autocast_eager)
    for ours, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    [warning] = [r.getMessage() for r in caplog.records if r.name.startswith("amp_graph")]
    assert "CountingLayer (layer 0 of the DynamicCache) changes its Python state updates" in warning
    assert "torch.autocast('cpu', bf16)" in warning and "policy O1" in warning
    assert not model.forward.compiled.decoder.graph_modules


def test_a_static_cache_is_written_in_place_in_the_users_tensors():
    model = _gpt2()
    prompt = _prompt()
    amp_graph.compile_(model, "autocast", BF16)
    cache = transformers.StaticCache(config=model.config, max_cache_len=12)
    model(input_ids=prompt, cache=cache, use_cache=True, cache_position=torch.arange(4))
    layer = cache.layers[0]
    keys, filled = layer.keys, layer.keys[:, :, :4].clone()
    pointer = keys.data_ptr()
    for position in (4, 5):
        ids = prompt[:, position - 4 : position - 3]
        at = torch.tensor([position])
        model(input_ids=ids, cache=cache, use_cache=True, cache_position=at)
    assert layer.keys is keys and keys.data_ptr() == pointer  # the user's tensor, written
    assert int(layer.cumulative_length) == 6
    assert torch.equal(keys[:, :, :4], filled) and keys[:, :, 4:6].abs().sum() > 0
    assert not keys[:, :, 6:].any()
    assert len(model.forward.compiled.decoder.graph_modules) == 2


def test_use_cache_without_a_cache_returns_the_cache_the_model_made():
    """HF makes a DynamicCache inside forward: the graph returns its tensors and the call
    gets a cache object of that class back, which the next call decodes with."""
    model = _gpt2()
    prompt = _prompt()
    with torch.autocast("cpu", BF16):
        first = model(input_ids=prompt, use_cache=True)
        second = model(input_ids=prompt[:, :1], cache=first.cache, use_cache=True)
    amp_graph.compile_(model, "autocast", BF16)
    ours = model(input_ids=prompt, use_cache=True)
    assert type(ours.cache) is transformers.DynamicCache and ours.cache is not first.cache
    assert ours.cache.layers[0].keys.dtype == BF16 and ours.cache.get_seq_length() == 4
    then = model(input_ids=prompt[:, :1], cache=ours.cache, use_cache=True)
    assert then.cache is ours.cache and ours.cache.get_seq_length() == 5
    torch.testing.assert_close(ours.logits, first.logits, rtol=0, atol=0)
    torch.testing.assert_close(then.logits, second.logits, rtol=0, atol=0)


def test_node_overrides_stay_out_of_decode_graphs_said_at_warning(caplog):
    model = _gpt2()
    prompt = _prompt()
    compiled = amp_graph.compile(model, "O1", BF16)
    name = next(
        n.name
        for n in compiled.capture(input_ids=prompt).graph.nodes
        if n.op == "call_function" and "addmm" in n.name
    )
    policy = amp_graph.Policy.preset("O1").override(nodes={name: "fp32"})
    compiled = amp_graph.compile(model, policy, BF16)
    with caplog.at_level(logging.WARNING, logger="amp_graph"):
        compiled.generate(prompt, max_new_tokens=2, do_sample=False, use_cache=True)
    [warning] = [r.getMessage() for r in caplog.records if r.name.startswith("amp_graph")]
    assert name in warning and "not applied to its decode graphs" in warning
    assert "modules=" in warning


def test_the_layout_of_a_cache_names_what_one_graph_cannot_take():
    cache = transformers.DynamicCache()
    assert cache_layout(cache).tensors == ()
    cache.stream = object()
    with pytest.raises(Exception, match=r"DynamicCache.stream is a object"):
        cache_layout(cache)


def test_a_failed_capture_with_symbolic_sizes_leaves_no_size_marks_on_the_inputs():
    """torch.export marks each input for Dim.AUTO and clears the marks only on success: left
    on the user's tensors, they made the static capture after a failed symbolic one
    symbolic too."""

    class Refuses(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] > 2:  # a guard on a symbolic size, then a failure in the trace
                raise CaptureError("refused")
            return x * 2

    x = torch.randn(4, 3)
    with pytest.raises(CaptureError):
        capture_module(Refuses(), (x,), {}, device_type="cpu", autocast_dtype=None, dynamic=True)
    assert not [name for name in vars(x) if "dynamo" in name]
    captured = capture_module(
        Refuses().eval(), (torch.randn(2, 3),), {}, device_type="cpu", autocast_dtype=None
    )
    assert all(
        isinstance(s, int)
        for s in captured.graph_module.graph.find_nodes(op="placeholder")[0].meta["val"].shape
    )


class _CastCount(torch.utils._python_dispatch.TorchDispatchMode):
    """The aten casts a call makes, by the shape of what they cast."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default:
            self.shapes[tuple(args[0].shape)] += 1
        return func(*args, **(kwargs or {}))


def _step_casts(model, ids, cache) -> Counter:
    with _CastCount() as count:
        model(input_ids=ids, cache=cache, use_cache=True)
    return count.shapes


def test_each_weight_is_cast_once_per_generation_as_under_one_autocast():
    """The decode graphs' casts of weights are made at the prefill and reused by every step
    while the cache object lives (torch.autocast around generate keeps its casts so too):
    a step casts activations alone; a weight changed in place is cast again; the casts go
    with the cache."""
    model = _gpt2()
    prompt = _prompt()
    # the products' weights: attention (32x96, 32x32), MLP (32x128, 128x32), head (100x32)
    weights = {(32, 96), (32, 32), (32, 128), (128, 32), (100, 32)}
    amp_graph.compile_(model, "O1", BF16)
    with torch.no_grad():
        warm = transformers.DynamicCache()  # the captures, whose traces would count too
        for ids in (prompt, prompt[:, :1], prompt[:, 1:2]):
            model(input_ids=ids, cache=warm, use_cache=True)
        cache = transformers.DynamicCache()
        prefill = _step_casts(model, prompt, cache)
        step = _step_casts(model, prompt[:, :1], cache)
        assert weights <= set(prefill)
        assert not set(step) & set(weights)  # no weight cast again
        model.lm_head.weight.mul_(2)  # tied to wte: an in-place change bumps its version
        again = _step_casts(model, prompt[:, 1:2], cache)
        assert again[tuple(model.lm_head.weight.shape)] >= 1
        assert not (set(again) - {tuple(model.lm_head.weight.shape)}) & set(weights)
        decoder = model.forward.compiled.decoder
        assert decoder._casts.held
        del cache
        assert decoder._casts.held is None  # the casts are freed with the cache


def test_reused_casts_decode_as_torch_autocast_does_step_by_step_and_weights_change():
    """Bitwise torch.autocast's logits over steps where a weight changes in place between
    steps (each step its own autocast region, so its casts are fresh: the reused cast of a
    changed weight must not be stale)."""
    model = _gpt2()
    prompt = _prompt()
    steps = [prompt, prompt[:, :1], prompt[:, 1:2], prompt[:, 2:3]]

    def run(call) -> list[torch.Tensor]:
        torch.manual_seed(0)
        with torch.no_grad():
            weight = model.transformer.h[0].mlp.c_fc.weight
            original = weight.clone()
            cache, logits = transformers.DynamicCache(), []
            for index, ids in enumerate(steps):
                if index == 2:
                    weight.mul_(0.5)
                logits.append(call(input_ids=ids, cache=cache, use_cache=True).logits)
            weight.copy_(original)
        return logits

    def autocast_eager(**kwargs):
        with torch.autocast("cpu", BF16):
            return type(model).forward(model, **kwargs)

    expected = run(autocast_eager)
    amp_graph.compile_(model, "autocast", BF16)
    got = run(model)
    for ours, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_with_gradients_a_decode_call_casts_anew_and_its_gradients_are_torch_autocasts():
    model = _gpt2()
    prompt = _prompt()

    def grads(call) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        cache = transformers.DynamicCache()
        call(input_ids=prompt, cache=cache, use_cache=True)
        call(input_ids=prompt[:, :1], cache=cache, use_cache=True).logits.float().sum().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    def autocast_eager(**kwargs):
        with torch.autocast("cpu", BF16):
            return type(model).forward(model, **kwargs)

    expected = grads(autocast_eager)
    amp_graph.compile_(model, "autocast", BF16)
    got = grads(model)
    assert got.keys() == expected.keys() and len(got) > 10
    for name in got:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)


def test_the_wrapper_called_with_a_cache_runs_the_decode_graphs():
    """``amp_graph.compile(model)(..., cache=...)``, not only ``compile_`` and ``generate``."""
    model = _gpt2()
    prompt = _prompt()
    expected_cache = transformers.DynamicCache()
    with torch.autocast("cpu", BF16):
        expected = [
            model(input_ids=ids, cache=expected_cache, use_cache=True).logits
            for ids in (prompt, prompt[:, :1])
        ]
    compiled = amp_graph.compile(model, "autocast", BF16)
    cache = transformers.DynamicCache()
    got = [
        compiled(input_ids=ids, cache=cache, use_cache=True).logits
        for ids in (prompt, prompt[:, :1])
    ]
    for ours, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert cache.get_seq_length() == 5 and len(compiled.decoder.graph_modules) == 2
    assert not compiled.graph_modules  # no forward graph was captured for these calls


def test_generate_under_inference_mode_is_torch_autocasts():
    model = _gpt2()
    prompt = _prompt()
    with torch.inference_mode(), torch.autocast("cpu", BF16):
        expected = model.generate(prompt, **GENERATE)
    amp_graph.compile_(model, "autocast", BF16)
    with torch.inference_mode():
        got = model.generate(prompt, **GENERATE)
    assert torch.equal(got.sequences, expected.sequences)
    for ours, theirs in zip(got.scores, expected.scores, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def _bart() -> transformers.BartForConditionalGeneration:
    config = transformers.BartConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.BartForConditionalGeneration(config).eval()


def test_an_encoder_decoder_generate_says_its_encoder_ran_outside_the_graph(caplog):
    """generate runs the encoder itself (model.get_encoder()), not through the compiled
    forward: in float32, said at WARNING with the way out (torch.autocast around generate,
    which then is torch.autocast's generate, bit for bit); its EncoderDecoderCache decodes
    under torch.autocast, said too."""
    model = _bart()
    prompt = _prompt(1, 6)
    options = dict(max_new_tokens=3, do_sample=False, use_cache=True)
    with torch.autocast("cpu", BF16):
        expected = model.generate(
            prompt, output_scores=True, return_dict_in_generate=True, **options
        )
    amp_graph.compile_(model, "O1", BF16)
    dtypes = []
    model.model.encoder.layers[0].fc1.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    with caplog.at_level(logging.WARNING, logger="amp_graph"):
        model.generate(prompt, **options)
    assert dtypes == [torch.float32]  # what the warning says
    said = [r.getMessage() for r in caplog.records if r.name.startswith("amp_graph")]
    [encoder] = [m for m in said if "ran its encoder" in m]
    assert "BartForConditionalGeneration" in encoder and "policy O1" in encoder
    assert "torch.autocast('cpu', dtype=torch.bfloat16)" in encoder
    assert any("EncoderDecoderCache" in m for m in said)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="amp_graph"), torch.autocast("cpu", BF16):
        got = model.generate(prompt, output_scores=True, return_dict_in_generate=True, **options)
    assert not [r for r in caplog.records if "ran its encoder" in r.getMessage()]
    assert dtypes[-1] == BF16  # the way out: the encoder under torch.autocast
    assert torch.equal(got.sequences, expected.sequences)
    for ours, theirs in zip(got.scores, expected.scores, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_a_batch_of_one_then_beams_captures_once_per_batch_kind_not_per_step():
    """torch.export specializes dims of size 1: a graph with symbolic sizes made at batch 1
    refuses batch 2 (two beams) and the reverse. Each gets its own pair of decode graphs,
    which then serve every length; they had been one static capture per step. Tokens and
    scores stay torch.autocast's."""
    model = _llama()
    prompt = _prompt(batch=1, length=5)
    beams = dict(GENERATE, num_beams=2, max_new_tokens=10)
    with torch.autocast("cpu", BF16):
        expected = [model.generate(prompt, **GENERATE), model.generate(prompt, **beams)]
    amp_graph.compile_(model, "autocast", BF16)
    got = [model.generate(prompt, **GENERATE), model.generate(prompt, **beams)]
    for ours, theirs in zip(got, expected, strict=True):
        assert torch.equal(ours.sequences, theirs.sequences)
        for a, b in zip(ours.scores, theirs.scores, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert len(model.forward.compiled.decoder.graph_modules) == 4
    model.generate(_prompt(batch=1, length=7), **beams)  # another length: no new graph
    assert len(model.forward.compiled.decoder.graph_modules) == 4


def test_following_the_encoder_advice_without_a_cache_draws_no_contrary_warning():
    """generate(use_cache=False) calls the compiled forward for the decoder, with the
    encoder's outputs: under the torch.autocast the encoder warning advises, the 'called
    inside torch.autocast: call it outside' warning would contradict it."""
    model = _bart()
    amp_graph.compile_(model, "O1", BF16)
    with warnings.catch_warnings(record=True) as caught, torch.autocast("cpu", BF16):
        warnings.simplefilter("always")
        model.generate(_prompt(1, 6), max_new_tokens=3, do_sample=False, use_cache=False)
    assert not [w for w in caught if "called inside torch.autocast" in str(w.message)]
    with warnings.catch_warnings(record=True) as caught, torch.autocast("cpu", BF16):
        warnings.simplefilter("always")
        model(_prompt(1, 6), decoder_input_ids=_prompt(1, 2), use_cache=False)
    assert [w for w in caught if "called inside torch.autocast" in str(w.message)]  # still said
