"""amp_graph.compile on model code as people write it (tests/zoo.py), held to torch.autocast.

For each model: under O1 every aten op gets the dtype CUDA autocast gives it (torch's own
AutocastCUDA kernels on fake CUDA tensors); under policy="autocast" on CPU the outputs are
bitwise those of torch.autocast("cpu"); a training step gives float32, finite gradients and
a loss close to float32's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import zoo
from amp_graph.passes import AMP, REGION, Role
from conftest import PlanReference, skip_where_cpu_lacks_kernels_of
from hf_configs import small_llama_config
from oracles import (
    assert_bitwise_cpu_autocast,
    assert_outputs_equal,
    check_training_step,
    cuda_autocast_mismatches,
)

import amp_graph
from amp_graph.frontends.compiler import compile_record

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def tokens(batch: int = 2, length: int = 12, vocab: int = 40) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length))


def ce_of(out) -> torch.Tensor:
    logits = out[0] if isinstance(out, tuple) else out
    return logits.float().logsumexp(-1).mean()


# name: (model factory, inputs factory, kwargs factory, loss of the output)
MODELS = {
    "nanogpt": (
        lambda: zoo.NanoGPT(),
        lambda: (tokens(2, 16, 96), tokens(2, 16, 96)),
        lambda out: out[1],
    ),
    "nanogpt_flash": (
        lambda: zoo.NanoGPT(zoo.GPTConfig(flash=True)),
        lambda: (tokens(2, 16, 96), tokens(2, 16, 96)),
        lambda out: out[1],
    ),
    "encoder": (lambda: zoo.EncoderClassifier(), lambda: (tokens(3, 10, 50),), ce_of),
    "encoder_norm_first_seq_first": (
        lambda: zoo.EncoderClassifier(batch_first=False, norm_first=True),
        lambda: (tokens(10, 3, 50),),
        ce_of,
    ),
    "mha_weights": (
        lambda: zoo.SelfAttention(need_weights=True),
        lambda: (torch.randn(2, 5, 16),),
        lambda out: out[0].float().pow(2).mean() + out[1].float().sum(),
    ),
    "mha_no_weights_seq_first": (
        lambda: zoo.SelfAttention(batch_first=False, need_weights=False),
        lambda: (torch.randn(5, 2, 16),),
        lambda out: out[0].float().pow(2).mean(),
    ),
    "lstm": (
        lambda: zoo.RNNModel("LSTM"),
        lambda: (tokens(7, 3, 40), zoo.RNNModel("LSTM").init_hidden(3)),
        lambda out: -out[0].float().mean(),
    ),
    "gru": (
        lambda: zoo.RNNModel("GRU"),
        lambda: (tokens(7, 3, 40), zoo.RNNModel("GRU").init_hidden(3)),
        lambda out: -out[0].float().mean(),
    ),
    "update_between_uses": (
        lambda: zoo.UpdateBetweenUses(),
        lambda: (torch.randn(4, 16),),
        lambda out: out.float().pow(2).mean(),
    ),
    "update_through_view": (
        lambda: zoo.UpdateThroughView(),
        lambda: (torch.randn(4, 16),),
        lambda out: out.float().pow(2).mean(),
    ),
    "disabled_region": (
        lambda: zoo.DisabledRegion(),
        lambda: (torch.randn(2, 6, 16),),
        lambda out: out.float().pow(2).mean(),
    ),
    "rotary": (
        lambda: zoo.RotaryAttention(),
        lambda: (torch.randn(2, 8, 32),),
        lambda out: out.float().pow(2).mean(),
    ),
    "maybe_autocast": (
        lambda: zoo.MaybeAutocast(),
        lambda: (torch.randn(2, 6, 16),),
        lambda out: out.float().pow(2).mean(),
    ),
}
# GRU on CPU: torch.autocast's CPU GRU kernel casts inside the recurrence (its linears) and
# returns the float32 hidden state's dtype; one aten.gru node can only be cast at its inputs.
CPU_AUTOCAST_DEVIATES = {"gru"}


def build(name: str):
    make_model, make_inputs, loss_of = MODELS[name]
    torch.manual_seed(0)
    model = make_model()
    torch.manual_seed(1)
    return model, make_inputs(), loss_of


@pytest.mark.parametrize("low", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_o1_gives_every_aten_op_the_dtype_cuda_autocast_gives_it(name: str, low: torch.dtype):
    model, inputs, _ = build(name)
    skip_where_cpu_lacks_kernels_of(model, low)
    compiled = amp_graph.compile(model, "O1", low, example_inputs=inputs, check_each_pass=True)
    unverifiable = ("gru",) if name == "gru" else ()  # aten::_thnn_fused_gru_cell: no meta
    mismatches = cuda_autocast_mismatches(compiled, inputs, unverifiable=unverifiable)
    assert not mismatches, "\n".join(mismatches)
    ops = [n for n in compiled.graph.nodes if n.meta[AMP].role is Role.OP]
    assert all(n.op == "call_function" for n in ops), "a module was left whole"


@pytest.mark.parametrize("name", sorted(set(MODELS) - CPU_AUTOCAST_DEVIATES))
def test_autocast_policy_is_bitwise_cpu_autocast(name: str):
    model, inputs, _ = build(name)
    skip_where_cpu_lacks_kernels_of(model)
    assert_bitwise_cpu_autocast(model, inputs)


# These overwrite, after a Linear read it, a float32 tensor the Linear saved for backward:
# float32 eager cannot train them either. Under O1 (as under torch.autocast) the Linear
# saved a low-precision copy, so they train.
OVERWRITE_SAVED = {"update_between_uses", "update_through_view"}


@pytest.mark.parametrize("policy", ["O1", "O2", "O3"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_training_step_gives_float32_finite_gradients(name: str, policy: str):
    if name in OVERWRITE_SAVED and policy != "O1":
        model, inputs, loss_of = build(name)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss_of(model(*inputs)).backward()  # float32 eager: the same error
        return
    model, inputs, loss_of = build(name)
    rtol = 0.05 if policy == "O1" else 0.1
    check_training_step(model, inputs, loss_of, policy, rtol=rtol)


def test_gru_deviation_from_cpu_autocast_is_the_documented_one():
    """CPU autocast runs GRU's inner linears in bf16 and returns a float32 output; amp_graph
    casts the one aten.gru node's inputs (as CUDA autocast's cuDNN path does): bf16 out."""
    model, inputs, _ = build("gru")
    skip_where_cpu_lacks_kernels_of(model)
    compiled = amp_graph.compile(model, "autocast")
    _, hidden = compiled(*inputs)
    with torch.autocast("cpu", dtype=BF16):
        _, ref_hidden = model(*inputs)
    assert ref_hidden.dtype == FP32 and hidden.dtype == BF16
    assert torch.allclose(hidden.float(), ref_hidden, atol=0.05)


# --- capture ------------------------------------------------------------------------------


def test_nanogpt_captures_at_first_call_and_again_for_a_new_signature():
    model = zoo.NanoGPT()
    compiled = amp_graph.compile(model, "O1")
    with pytest.raises(RuntimeError, match="not been captured yet"):
        compiled.graph_module  # noqa: B018
    logits, loss = compiled(tokens(4, 16, 96), tokens(4, 16, 96))
    assert loss.dtype == FP32 and logits.dtype == BF16
    assert "torch.bfloat16" in compiled.code and "linear" in str(compiled)
    # inference form (no targets): another structure, another graph
    logits, loss = compiled(tokens(2, 8, 96))
    assert loss is None and logits.shape == (2, 1, 96)
    assert len(compiled.graph_modules) == 2
    # new sizes of a known structure: one more capture, with symbolic sizes, then reused
    for t in (5, 11, 32):
        compiled(tokens(3, t, 96), tokens(3, t, 96))
    assert len(compiled.graph_modules) == 3
    with pytest.raises(AssertionError, match="Cannot forward"):  # the model's own assert
        compiled(tokens(2, 40, 96), tokens(2, 40, 96))


def test_training_flag_is_part_of_the_signature():
    model = zoo.NanoGPT(zoo.GPTConfig(dropout=0.5))
    compiled = amp_graph.compile(model, "O1")
    idx = tokens(2, 8, 96)
    compiled(idx, idx)
    model.eval()
    a, _ = compiled(idx, idx)
    b, _ = compiled(idx, idx)
    assert torch.equal(a, b), "dropout ran in eval mode"
    assert len(compiled.graph_modules) == 2


def test_example_inputs_capture_at_once_and_kwargs_work():
    model = zoo.NanoGPT()
    idx = tokens(2, 8, 96)
    compiled = amp_graph.compile(model, example_inputs=(idx,), example_kwargs={"targets": idx})
    assert len(compiled.graph_modules) == 1
    assert "cross_entropy" in compiled.code or "nll_loss" in compiled.code
    _, loss = compiled(idx, targets=idx)
    assert loss.dtype == FP32


def test_parameters_are_shared_and_read_at_call_time():
    model = zoo.NanoGPT()
    compiled = amp_graph.compile(model, "O1", example_inputs=(tokens(2, 8, 96),))
    gm = compiled.graph_module
    assert gm.model is model
    assert {id(p) for p in compiled.parameters()} == {id(p) for p in model.parameters()}
    # a buffer replaced after compiling (as module.to() does) is what the graph reads
    new_mask = torch.zeros_like(model.transformer.h[0].attn.bias)
    model.transformer.h[0].attn.bias = new_mask
    assert gm.model.transformer.h[0].attn.bias is new_mask


def test_model_is_not_modified():
    model = zoo.EncoderClassifier()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modules = [(n, type(m)) for n, m in model.named_modules()]
    compiled = amp_graph.compile(model, "O2", example_inputs=(tokens(2, 6, 50),))
    compiled(tokens(2, 6, 50))
    assert [(n, type(m)) for n, m in model.named_modules()] == modules
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.dtype == FP32 for p in model.parameters())


def test_lstm_hidden_state_carried_across_batches_matches_autocast():
    model = zoo.RNNModel("LSTM")
    skip_where_cpu_lacks_kernels_of(model)
    compiled = amp_graph.compile(model, "autocast")
    hidden_ours = hidden_ref = model.init_hidden(3)
    try:
        with torch.autocast("cpu", dtype=BF16):
            model(tokens(7, 3, 40), hidden_ref)
    except RuntimeError as error:  # no bf16 LSTM in oneDNN without bf16 instructions
        for _ in range(3):  # the compiled graph runs torch's own bf16 kernel: it still works
            out, hidden_ours = compiled(tokens(7, 3, 40), zoo.repackage_hidden(hidden_ours))
            assert torch.isfinite(out.float()).all()
        assert len(compiled.graph_modules) == 2
        pytest.skip(f"torch.autocast cannot run the LSTM on this CPU to compare: {error}")
    for step in range(3):
        data = tokens(7, 3, 40)
        out, hidden_ours = compiled(data, zoo.repackage_hidden(hidden_ours))
        with torch.autocast("cpu", dtype=BF16):
            ref, hidden_ref = model(data, zoo.repackage_hidden(hidden_ref))
        assert_outputs_equal((out, hidden_ours), (ref, hidden_ref), f"step {step}")
    # the carried state is bf16 after the first step: another input signature, recaptured
    assert len(compiled.graph_modules) == 2


def test_mha_softmax_and_weights_stay_float32_under_o1():
    model, inputs, _ = build("mha_weights")
    compiled = amp_graph.compile(model, "O1", example_inputs=inputs)
    out, weights = compiled(*inputs)
    assert out.dtype == BF16 and weights.dtype == FP32
    softmaxes = [n for n in compiled.graph.nodes if "softmax" in n.meta[AMP].op]
    assert softmaxes and {n.meta[AMP].compute_dtype for n in softmaxes} == {FP32}
    assert {n.meta[AMP].module_path for n in softmaxes} == {"attn"}


def test_transformer_encoder_runs_its_matmuls_in_low_precision():
    model, inputs, _ = build("encoder")
    compiled = amp_graph.compile(model, "O1", example_inputs=inputs)
    linears = [n for n in compiled.graph.nodes if n.meta[AMP].aten in ("linear", "matmul", "bmm")]
    assert len(linears) >= 8
    assert {n.meta[AMP].compute_dtype for n in linears} == {BF16}
    assert any(n.meta[AMP].module_path.startswith("encoder.layers.1") for n in linears)


# --- in-place updates and views -----------------------------------------------------------


@pytest.mark.parametrize("name", ["update_between_uses", "update_through_view"])
@pytest.mark.parametrize("policy", ["O1", "autocast", "O3"])
def test_in_place_updates_never_reuse_a_stale_cast(name: str, policy: str):
    """Bitwise the plan reference: the captured graph run with each op's inputs cast at
    run time, as torch.autocast casts (no cast outlives a write), at the plan's dtypes."""
    model, inputs, _ = build(name)
    compiled = amp_graph.compile(model, policy, example_inputs=inputs, check_each_pass=True)
    ours = compiled(*inputs)
    reference = PlanReference(compiled.graph_module).run(*inputs)
    assert torch.equal(ours, reference)
    if policy != "O3":  # the plan is autocast's: so are the numbers
        with torch.autocast("cpu", dtype=compiled.dtype):
            assert torch.equal(ours, model(*inputs))


@pytest.mark.parametrize("policy", ["O1", "O2", "O3"])
def test_writes_to_the_input_reach_the_callers_tensor(policy: str):
    model = zoo.UpdatesInput()
    x = torch.randn(4, 16)
    expected = x + 1.0
    compiled = amp_graph.compile(model, policy, example_inputs=(x.clone(),), check_each_pass=True)
    compiled(x)
    assert x.dtype == FP32 and torch.equal(x, expected)


@pytest.mark.parametrize("policy", ["O1", "O3"])
def test_embedding_max_norm_renormalizes_the_parameter_itself(policy: str):
    model = zoo.EmbeddingMaxNorm()
    reference = zoo.EmbeddingMaxNorm()
    reference.load_state_dict(model.state_dict())
    idx = torch.randint(0, 20, (3, 5))
    compiled = amp_graph.compile(model, policy, check_each_pass=True)
    compiled(idx)
    reference(idx)
    assert torch.equal(model.weight, reference.weight)
    assert model.weight.norm(dim=1)[idx.unique()].max() <= 1.0 + 1e-5


# --- autocast regions -----------------------------------------------------------------------


def test_disabled_region_casts_nothing_inside():
    model, inputs, _ = build("disabled_region")
    compiled = amp_graph.compile(model, "O3", example_inputs=inputs, check_each_pass=True)
    inside = [n for n in compiled.graph.nodes if n.meta.get(REGION) is not None]
    assert inside, "the region was not recorded"
    assert all(not n.meta[REGION].enabled for n in inside)
    for node in inside:
        amp = node.meta[AMP]
        assert amp.compute_dtype is None, f"{node.name} is cast inside enabled=False"
    matmuls = [n for n in inside if n.meta[AMP].aten == "matmul"]
    assert matmuls and {n.meta[AMP].out_dtype for n in matmuls} == {FP32}
    assert "wrap_with_autocast" not in compiled.code and "autocast" not in compiled.code


def test_nested_region_uses_its_own_dtype():
    model = zoo.NestedRegion()
    x = torch.randn(4, 16)
    compiled = amp_graph.compile(model, "O1", BF16, example_inputs=(x,), check_each_pass=True)
    linears = {n.meta[AMP].module_path: n.meta[AMP] for n in compiled.graph.nodes
               if n.meta[AMP].aten == "linear"}  # fmt: skip
    assert linears["a"].compute_dtype == BF16 and linears["b"].compute_dtype == FP16
    with torch.autocast("cpu", dtype=BF16):
        reference = model(x)
    assert_outputs_equal(amp_graph.compile(model, "autocast")(x), reference, "nested")


def test_compile_counts_each_region_once():
    """inline_regions runs once per compile (it used to run again in the pipeline, which then
    found nothing and reported 0 regions)."""
    model = zoo.NestedRegion()
    compiled = amp_graph.compile(model, "O1", BF16, example_inputs=(torch.randn(4, 16),))
    regions = {id(n.meta[REGION]) for n in compiled.graph.nodes if n.meta.get(REGION)}
    assert regions, "the region was not recorded"
    record = compile_record(compiled)
    assert record.stats["autocast_regions"] == len(regions)
    assert "inline_regions" in record.seconds


def test_o0_honours_the_models_own_enabled_region():
    model = zoo.NestedRegion()
    x = torch.randn(4, 16)
    compiled = amp_graph.compile(model, "O0", example_inputs=(x,), check_each_pass=True)
    linears = {n.meta[AMP].module_path: n.meta[AMP] for n in compiled.graph.nodes
               if n.meta[AMP].aten == "linear"}  # fmt: skip
    assert linears["a"].compute_dtype is None and linears["b"].compute_dtype == FP16
    assert torch.equal(compiled(x), model(x))


def test_maybe_autocast_region_is_captured_because_capture_runs_under_autocast():
    model, inputs, _ = build("maybe_autocast")
    compiled = amp_graph.compile(model, "O1", example_inputs=inputs)
    matmul = next(n for n in compiled.graph.nodes if n.meta[AMP].aten == "matmul")
    assert matmul.meta[REGION].enabled is False and matmul.meta[AMP].out_dtype == FP32
    assert compiled(*inputs).dtype == FP32


def test_rotary_buffer_to_device_does_not_pin_under_o2():
    model, inputs, _ = build("rotary")
    compiled = amp_graph.compile(model, "O2", example_inputs=inputs, check_each_pass=True)
    nodes = {n.name: n.meta[AMP] for n in compiled.graph.nodes}
    sdpa = [a for a in nodes.values() if a.aten == "scaled_dot_product_attention"]
    assert sdpa and sdpa[0].compute_dtype == BF16, "attention was pinned to fp32"
    freqs = [a for a in nodes.values() if a.aten == "matmul" and a.module_path == "rotary"]
    assert freqs and freqs[0].out_dtype == FP32  # inside the model's enabled=False block


def test_a_float_that_changes_nothing_does_not_pin():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            h = F.layer_norm(x, (8,)).float()  # fp32 already under O2 (a norm): a no-op
            return self.b(self.a(h))

    compiled = amp_graph.compile(M(), "O2", example_inputs=(torch.randn(2, 8),))
    linears = [n.meta[AMP] for n in compiled.graph.nodes if n.meta[AMP].aten == "linear"]
    assert {a.compute_dtype for a in linears} == {BF16}


# --- HF transformers -----------------------------------------------------------------------


def _hf_models():
    transformers = pytest.importorskip("transformers")
    ids = torch.randint(0, 100, (2, 12))
    small = dict(vocab_size=100, use_cache=False)
    return {
        "gpt2": (
            lambda: transformers.GPT2LMHeadModel(
                transformers.GPT2Config(n_positions=32, n_embd=32, n_layer=2, n_head=2, **small)
            ),
            {"input_ids": ids, "labels": ids},
        ),
        "bert": (
            lambda: transformers.BertForSequenceClassification(
                transformers.BertConfig(
                    hidden_size=32,
                    num_hidden_layers=2,
                    num_attention_heads=2,
                    intermediate_size=64,
                    max_position_embeddings=32,
                    **small,
                )
            ),
            {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids[:, 0] % 2},
        ),
        "llama": (
            lambda: transformers.LlamaForCausalLM(small_llama_config()),
            {"input_ids": ids, "labels": ids},
        ),
        "t5": (
            lambda: transformers.T5ForConditionalGeneration(
                transformers.T5Config(
                    d_model=32,
                    d_kv=8,
                    d_ff=64,
                    num_layers=2,
                    num_heads=4,
                    decoder_start_token_id=0,
                    **small,
                )
            ),
            {"input_ids": ids, "labels": ids},
        ),
        "vit": (
            lambda: transformers.ViTForImageClassification(
                transformers.ViTConfig(
                    image_size=32,
                    patch_size=8,
                    hidden_size=32,
                    num_hidden_layers=2,
                    num_attention_heads=2,
                    intermediate_size=64,
                    num_labels=3,
                )
            ),
            {"pixel_values": torch.randn(2, 3, 32, 32), "labels": torch.tensor([0, 2])},
        ),
    }


HF_NAMES = ["gpt2", "bert", "llama", "t5", "vit"]


def _hf(name: str):
    make, kwargs = _hf_models()[name]
    torch.manual_seed(0)
    return make(), kwargs


@pytest.mark.parametrize("name", HF_NAMES)
def test_hf_o1_matches_cuda_autocast_per_op(name: str):
    model, kwargs = _hf(name)
    compiled = amp_graph.compile(model, "O1", example_kwargs=kwargs, check_each_pass=True)
    mismatches = cuda_autocast_mismatches(compiled, (), kwargs)
    assert not mismatches, "\n".join(mismatches)


@pytest.mark.parametrize("name", HF_NAMES)
def test_hf_autocast_policy_is_bitwise_cpu_autocast(name: str):
    model, kwargs = _hf(name)
    assert_bitwise_cpu_autocast(model, (), kwargs)


@pytest.mark.parametrize("name", HF_NAMES)
def test_hf_training_step_without_example_inputs(name: str):
    model, kwargs = _hf(name)
    check_training_step(model, (), lambda out: out.loss, "O1", kwargs=kwargs)


def test_hf_cache_output_gets_a_specific_error():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=100, n_positions=32, n_embd=32, n_layer=1, n_head=2, use_cache=True
    )
    model = transformers.GPT2LMHeadModel(config)
    compiled = amp_graph.compile(model, "O1")
    with pytest.raises(amp_graph.CaptureError, match="use_cache=False"):
        compiled(input_ids=torch.randint(0, 100, (2, 8)))


# --- structured values in a graph you bring -------------------------------------------------


def test_a_symbolic_trace_with_a_tuple_state_casts_each_element():
    """The word-language-model LSTM traced by torch.fx, its (h, c) state one tuple input: the
    GraphModule is captured as any module (one IR), each element of the state becomes an input
    and O1 casts each. The production verifier (not only check_each_pass) catches a missing
    cast of one of them."""
    import torch.fx as fx
    from amp_graph.passes import VerificationError
    from amp_graph.passes.verify import verify

    from amp_graph.frontends.cpu_low_kernels import missing_low_kernels

    model = zoo.RNNModel("LSTM")
    traced = fx.symbolic_trace(model)
    data, hidden = tokens(7, 3, 40), model.init_hidden(3)
    if "lstm" in missing_low_kernels(BF16):
        # an AVX2-only CPU: no bf16 LSTM kernel (torch.autocast raises); the plan keeps the
        # LSTM and its state float32 and runs (tests/test_cpu_kernels.py checks the rest)
        with pytest.warns(UserWarning, match="no low-precision kernel for lstm"):
            compiled = amp_graph.compile(traced, "O1", example_inputs=(data, hidden))
        _, (h, c) = compiled(data, hidden)
        assert h.dtype == c.dtype == torch.float32
        return
    compiled = amp_graph.compile(traced, "O1", example_inputs=(data, hidden))
    casts = {n.args[0].name: n for n in compiled.graph.nodes if n.meta[AMP].role is Role.CAST}
    assert {"hidden_0", "hidden_1"} <= set(casts)
    assert all(casts[h].args[1] == BF16 for h in ("hidden_0", "hidden_1"))
    out, (h, c) = compiled(data, hidden)
    assert h.dtype == c.dtype == BF16 and torch.isfinite(out.float()).all()
    try:
        with torch.autocast("cpu", dtype=BF16):  # same dtypes as eager CPU autocast on the model
            _, (h_ref, c_ref) = model(data, hidden)
        assert h_ref.dtype == h.dtype and c_ref.dtype == c.dtype
    except RuntimeError as error:
        # oneDNN on an AVX2-only CPU has no primitive for autocast's own bf16 LSTM call, while
        # the graph's (its weights cast by the graph, as the probes of cpu_low_kernels run it)
        # computes: only the oracle cannot run here
        assert "primitive descriptor for the LSTM" in str(error)
    gm = compiled.graph_module
    cast = casts["hidden_1"]
    cast.replace_all_uses_with(cast.args[0])
    gm.graph.erase_node(cast)
    with pytest.raises(VerificationError, match="holds a fp32 tensor: a cast is missing"):
        verify(gm, propagate=False)
