"""The model stays the user's object: ``amp_graph.compile_`` keeps an HF model's class,
attributes and checkpoint format, and HF ``Trainer`` trains it with default arguments."""

from __future__ import annotations

import copy
import inspect
import logging
import warnings
from pathlib import Path

import pytest
import torch
from hf_configs import small_gpt2_config

import amp_graph
from amp_graph.ops.recompute_ops import recomputed_cast

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

VOCAB, SEQ = 100, 16


def _gpt2() -> transformers.GPT2LMHeadModel:
    """A tiny random GPT-2; ``use_cache=False`` for training (a cache is not a graph output)."""
    return transformers.GPT2LMHeadModel(small_gpt2_config(VOCAB))


def _ids(batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(1))


def _dataset(rows: int = 4) -> list[dict[str, torch.Tensor]]:
    """One repeated set of rows, with a column the model does not take (Trainer drops it by
    the forward's signature)."""
    ids = _ids(rows)
    return [
        {"input_ids": r, "attention_mask": torch.ones_like(r), "labels": r, "row": torch.tensor(i)}
        for i, r in enumerate(ids)
    ]


def _trainer(model: torch.nn.Module, out: Path, **args: object) -> transformers.Trainer:
    arguments = transformers.TrainingArguments(
        output_dir=str(out),
        report_to=[],
        max_steps=8,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        logging_steps=1,
        use_cpu=True,
        save_strategy="no",
        **args,
    )
    return transformers.Trainer(model=model, args=arguments, train_dataset=_dataset())


def _losses(trainer: transformers.Trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_compile_in_place_keeps_the_model_class_attributes_and_state_dict_keys():
    model = _gpt2().eval()
    keys, signature = list(model.state_dict()), inspect.signature(model.forward)
    assert amp_graph.compile_(model, "O1") is model
    assert isinstance(model, transformers.GPT2LMHeadModel) and model.config.n_embd == 32
    assert list(model.state_dict()) == keys and inspect.signature(model.forward) == signature
    ids = _ids()
    out = model(input_ids=ids, labels=ids)  # the graph runs (no recursion into itself)
    gm = amp_graph.frontends.compiler.as_graph_module(model)
    casts = (torch.ops.aten.to.dtype, recomputed_cast)  # the model's own, as written or decided
    assert any(n.target in casts for n in gm.graph.nodes if n.op != "output")
    assert "bfloat16" in gm.code
    with pytest.raises(ValueError, match="compiled in place already"):
        amp_graph.compile_(model)
    clone = copy.deepcopy(model)  # its graph reads the copy's parameters
    assert clone.forward.compiled.model is clone and clone.forward.run.__self__.model is clone
    amp_graph.uncompile(model)
    assert "forward" not in model.__dict__
    torch.testing.assert_close(out.loss, model(input_ids=ids, labels=ids).loss, atol=2e-2, rtol=0)
    with pytest.raises(ValueError, match="not compiled in place"):
        amp_graph.uncompile(model)


@pytest.mark.parametrize("policy", ["autocast", "O1"])
def test_generate_with_a_kv_cache_decodes_as_under_torch_autocast(caplog, policy):
    """HF generate (use_cache=True: every call holds a KV cache) runs decode graphs, the
    cache's tensors their inputs and outputs: tokens equal those of generate under
    torch.autocast, and under ``"autocast"`` every step's scores too, bit for bit; O1's
    (CUDA-derived tables) are within bf16 rounding. Both differ from float32's. Two graphs
    (the prefill, and one decode step with symbolic sizes) serve every step, and nothing is
    said at WARNING."""
    model = _gpt2().eval()
    prompt = _ids()[:, :4]
    generate = dict(
        max_new_tokens=6,
        do_sample=False,
        use_cache=True,
        output_scores=True,
        return_dict_in_generate=True,
    )
    in_float32 = model.generate(prompt, **generate)
    with torch.autocast("cpu", torch.bfloat16):
        expected = model.generate(prompt, **generate)
    amp_graph.compile_(model, policy, torch.bfloat16, example_kwargs={"input_ids": prompt})
    with caplog.at_level(logging.INFO, logger="amp_graph"):
        got = model.generate(prompt, **generate)
        model.generate(prompt, **generate)
    assert torch.equal(got.sequences, expected.sequences)
    for ours, theirs, fp32 in zip(got.scores, expected.scores, in_float32.scores, strict=True):
        if policy == "autocast":
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
        else:
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-2)
        assert not torch.equal(ours, fp32)  # mixed precision, not the float32 model
    assert not [r for r in caplog.records if r.name.startswith("amp_graph") and r.levelno >= 30]
    compiled = model.forward.compiled
    assert len(compiled.graph_modules) == 1  # the forward, captured with example_kwargs
    assert len(compiled.decoder.graph_modules) == 2  # prefill, decode: any length


def test_trainer_with_default_arguments_trains_and_saves_a_loadable_checkpoint(tmp_path):
    model = amp_graph.compile_(_gpt2(), "O1")
    trainer = _trainer(model, tmp_path / "run")
    trainer.train()
    losses = _losses(trainer)
    assert len(losses) == 8 and losses[-1] < 0.8 * losses[0]
    assert (
        amp_graph.frontends.compiler.as_graph_module(model) is not None
    )  # trained through the graph
    trainer.save_model(str(tmp_path / "saved"))
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "saved")
    assert type(loaded) is transformers.GPT2LMHeadModel
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


@pytest.mark.parametrize("flag, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_trainer_bf16_fp16_autocast_is_turned_off_inside_the_graph_warning_once(
    tmp_path, flag, dtype
):
    model = amp_graph.compile_(_gpt2(), "O1", dtype)
    trainer = _trainer(model, tmp_path / "run", **{flag: True})
    assert trainer.accelerator.scaler is None  # on CPU accelerate adds none, fp16 included
    assert trainer.accelerator.mixed_precision == flag
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    inside = [w for w in caught if "inside torch.autocast" in str(w.message)]
    autocasts = trainer.accelerator.native_amp
    assert autocasts == (flag == "bf16")  # on CPU accelerate autocasts for bf16 only
    assert len(inside) == autocasts
    assert all("docs/integrations.md" in str(w.message) for w in inside)
    losses = _losses(trainer)
    assert losses[-1] < 0.8 * losses[0]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert str(dtype) in amp_graph.frontends.compiler.as_graph_module(model).code


def test_trainer_takes_the_wrapper_too_its_signature_keeps_the_columns(tmp_path):
    trainer = _trainer(amp_graph.compile(_gpt2(), "O1"), tmp_path / "run")
    trainer.train()  # default remove_unused_columns: the columns forward names are kept
    assert _losses(trainer)[-1] < 0.8 * _losses(trainer)[0]


def test_wrapper_shows_config_generate_and_save_pretrained_of_the_model(tmp_path):
    model = _gpt2().eval()
    compiled = amp_graph.compile(model, "O1")
    assert compiled.config is model.config
    assert compiled.generate.__wrapped__ == model.generate  # run so that it decodes low
    assert inspect.signature(compiled.forward) == inspect.signature(model.forward)
    compiled.save_pretrained(tmp_path)  # the model's own method: its own keys
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    assert loaded.state_dict().keys() == model.state_dict().keys()


@pytest.mark.parametrize("use_cache", [True, False])
def test_the_wrappers_generate_decodes_as_under_torch_autocast_not_in_float32(caplog, use_cache):
    """``amp_graph.compile(model).generate``: the model's own generate, whose calls of the
    model run the graph (without a cache: one capture per shape, then symbolic sizes) or,
    with a KV cache, the decode graphs. It decoded in float32 before."""
    model = _gpt2().eval()
    prompt = _ids()[:, :4]
    generate = dict(max_new_tokens=4, do_sample=False, use_cache=use_cache)
    generate.update(output_scores=True, return_dict_in_generate=True)
    in_float32 = model.generate(prompt, **generate)
    with torch.autocast("cpu", torch.bfloat16):
        expected = model.generate(prompt, **generate)
    compiled = amp_graph.compile(model, "autocast", torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="amp_graph.frontends.model_forwards"):
        got = compiled.generate(prompt, **generate)
    assert torch.equal(got.sequences, expected.sequences)
    for ours, theirs, fp32 in zip(got.scores, expected.scores, in_float32.scores, strict=True):
        assert ours.dtype == theirs.dtype
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
        assert not torch.equal(ours, fp32)  # mixed precision, not the float32 model
    assert "forward" not in model.__dict__  # the model is as it was after generate
    assert bool(compiled.graph_modules) is not use_cache  # without a cache: the graph ran
    assert bool(compiled.decoder.graph_modules) is use_cache
    assert not [r for r in caplog.records if r.name.startswith("amp_graph") and r.levelno >= 30]


def test_the_wrappers_generate_over_a_model_wrapped_by_another_library_warns(caplog):
    """A forward set on the instance by another library is left alone: generate then runs
    the model's own code, in float32, and says so at WARNING with the way out."""
    model = _gpt2().eval()
    own = model.forward
    model.forward = lambda *args, **kwargs: own(*args, **kwargs)  # another library's wrapper
    compiled = amp_graph.compile(model, "O1", torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="amp_graph.frontends.model_forwards"):
        compiled.generate(_ids()[:, :4], max_new_tokens=2, do_sample=False)
    [warning] = [r.getMessage() for r in caplog.records if r.name.startswith("amp_graph")]
    assert "in float32, not the graph" in warning and "amp_graph.compile_" in warning
    assert model.__dict__["forward"] is not None and "forward" in model.__dict__


@pytest.mark.parametrize(
    "options",
    [dict(num_beams=2), dict(cache_implementation="static")],
    ids=["beam-search", "static-cache"],
)
def test_beam_search_and_a_static_cache_decode_as_under_torch_autocast(options):
    """Beam search reorders the cache between the graphs' calls: bit for bit with autocast.
    A static cache is one graph whose writes (``index_copy_``) land in the user's tensors;
    its graph attends over the whole cache, masked, as HF's code does under torch.compile and
    export, where eager slices it to the filled length: the same tokens, scores within bf16
    rounding."""
    model = _gpt2().eval()
    prompt = _ids()[:, :4]
    generate = dict(max_new_tokens=4, do_sample=False, use_cache=True, **options)
    generate.update(output_scores=True, return_dict_in_generate=True)
    with torch.autocast("cpu", torch.bfloat16):
        expected = model.generate(prompt, **generate)
    amp_graph.compile_(model, "autocast", torch.bfloat16, example_kwargs={"input_ids": prompt})
    got = model.generate(prompt, **generate)
    assert torch.equal(got.sequences, expected.sequences)
    exact = "num_beams" in options
    for ours, theirs in zip(got.scores, expected.scores, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0 if exact else 1e-2)
    assert len(model.forward.compiled.decoder.graph_modules) == 2
