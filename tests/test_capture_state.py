"""What a capture must not take from the user, or take twice: the seeded random stream, the
root's hooks under ``compile_``, a backward hook export would drop, an input's layout, and
the line an error names.

The oracle is the same model under ``torch.autocast`` (policy ``"autocast"``: bit for bit).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import amp_graph
from amp_graph.frontends import cpu_low_kernels

BF16 = torch.bfloat16


class MLP(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(torch.relu(self.fc1(x))))


def autocast(model: nn.Module, *args: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=BF16):
        return model(*args)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a, b)


# -- the seeded stream --------------------------------------------------------------------


def test_compiling_leaves_the_seeded_random_stream_where_it_was():
    """The CPU kernel probe builds recurrent layers, whose initialization draws from
    torch's generator: compiling must not move the user's stream (forked)."""
    cpu_low_kernels.reprobe()  # the probe runs once per process: make this call run it
    model = MLP()
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    amp_graph.compile(model, "O1", BF16)
    assert torch.equal(torch.rand(4), expected)


def test_a_graph_first_step_draws_autocast_dropout_mask():
    """After ``torch.manual_seed``, a Graph's first step (where the probe runs) drops the
    same units as the step under torch.autocast."""
    cpu_low_kernels.reprobe()
    torch.manual_seed(0)
    model = MLP(dropout=0.5)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)

    class Step(amp_graph.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.add_optimizer(optimizer)
            self.config.enable_amp(True, policy="autocast", dtype=BF16)

        def build(self, x: torch.Tensor) -> torch.Tensor:
            out = self.model(x)
            out.float().sum().backward()
            return out

    step, x = Step(), torch.randn(64, 16)
    for _ in range(2):
        torch.manual_seed(7)
        ours = step(x)
        torch.manual_seed(7)
        assert same(ours, autocast(reference, x))


# -- the root's hooks under compile_ --------------------------------------------------------


def test_compile_in_place_runs_the_root_hooks_once():
    """``nn.Module.__call__`` runs the root's hooks around the forward ``compile_`` sets: the
    graph must not run them again (they ran twice: the output was 2x autocast's)."""
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    calls: list[str] = []
    for m, log in ((model, calls), (reference, [])):
        m.register_forward_pre_hook(lambda mod, args, log=log: (log.append("pre"), None)[1])
        m.register_forward_hook(lambda mod, args, out, log=log: (log.append("post"), 2 * out)[1])
        m.fc1.register_forward_hook(lambda mod, args, out: out + 1)  # a child's: in the graph
    amp_graph.compile_(model, "autocast", BF16)
    x = torch.randn(4, 16)
    for _ in range(2):
        calls.clear()
        assert same(model(x), autocast(reference, x))
        assert calls == ["pre", "post"]


def test_compile_in_place_sees_root_hooks_added_and_removed_after_capture():
    """The root's hooks run outside the graph, so one added or removed later takes effect."""
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    amp_graph.compile_(model, "autocast", BF16)
    x = torch.randn(4, 16)
    model(x)  # captured
    handles = [m.register_forward_hook(lambda mod, a, out: out * 3) for m in (model, reference)]
    assert same(model(x), autocast(reference, x))
    for handle in handles:
        handle.remove()
    assert same(model(x), autocast(reference, x))


def test_compile_in_place_decodes_with_the_root_hook_once():
    """HF ``generate`` calls the model with a KV cache: the decode graphs run inside its
    ``__call__`` too, so their captures leave the root's hooks out as well."""
    transformers = pytest.importorskip("transformers")
    from hf_configs import small_gpt2_config

    def halve_logits(module: nn.Module, args: tuple, out: dict) -> dict:
        out["logits"] = out["logits"] / 2
        return out

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(small_gpt2_config(100)).eval()
    model.register_forward_hook(halve_logits)
    prompt = torch.randint(1, 100, (2, 4), generator=torch.Generator().manual_seed(1))
    settings = dict(max_new_tokens=4, do_sample=False, use_cache=True, output_logits=True)
    settings.update(return_dict_in_generate=True)
    with torch.autocast("cpu", BF16):
        expected = model.generate(prompt, **settings)
    amp_graph.compile_(model, "autocast", BF16)
    got = model.generate(prompt, **settings)
    assert len(model.forward.compiled.decoder.graph_modules) == 2
    assert torch.equal(got.sequences, expected.sequences)
    for ours, theirs in zip(got.logits, expected.logits, strict=True):
        assert same(ours, theirs)


# -- backward hooks ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "register",
    [
        lambda m: m.register_full_backward_hook(lambda mod, gin, gout: None),
        lambda m: m.register_full_backward_pre_hook(lambda mod, gout: None),
    ],
    ids=["full_backward_hook", "full_backward_pre_hook"],
)
def test_a_backward_hook_export_would_drop_is_refused(register):
    """torch.export drops module backward hooks: the graph's backward never called them, with
    no error. Now the capture refuses, naming the module and the hooks that do fire."""
    model = MLP()
    register(model.fc2)
    with pytest.raises(amp_graph.CaptureError, match=r"module fc2 has a backward hook") as info:
        amp_graph.compile(model, "O1", BF16)(torch.randn(4, 16))
    assert "param.register_hook" in str(info.value)


def test_the_parameter_hooks_the_refusal_names_fire_as_under_autocast():
    """The way out the error names: hooks on the parameters see autocast's gradients."""
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    seen: dict[str, list[torch.Tensor]] = {"ours": [], "autocast": []}
    for m, key in ((model, "ours"), (reference, "autocast")):
        m.fc2.weight.register_hook(lambda grad, key=key: seen[key].append(grad.clone()))
    x = torch.randn(4, 16)
    amp_graph.compile(model, "autocast", BF16)(x).float().sum().backward()
    autocast(reference, x).float().sum().backward()
    assert len(seen["ours"]) == 1
    assert same(seen["ours"][0], seen["autocast"][0])


# -- the input's layout -----------------------------------------------------------------------


class Flatten(nn.Module):
    """``.contiguous()`` before a view: a no-op on a contiguous input, so a graph traced on
    one has no copy there."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.contiguous().view(x.size(0), -1))


@pytest.mark.parametrize("first", ["contiguous", "transposed"])
def test_an_input_of_another_layout_gets_its_own_graph(first):
    """A transposed input of the captured shape reused the contiguous input's graph, whose
    ``view`` then raised from generated code; each layout now has its graph, and both
    match autocast in either order (the last call's fast path included)."""
    torch.manual_seed(0)
    model = Flatten()
    reference = copy.deepcopy(model)
    fast = amp_graph.compile(model, "autocast", BF16)
    contiguous = torch.randn(2, 3, 4)
    transposed = torch.randn(2, 4, 3).transpose(1, 2)
    order = [contiguous, transposed] if first == "contiguous" else [transposed, contiguous]
    for x in order + order:
        assert same(fast(x), autocast(reference, x))
    assert len(fast.graph_modules) == 2


# -- the line a capture error names --------------------------------------------------------


def test_a_capture_error_names_the_library_line_not_generated_code():
    """A data-dependent branch in an installed library's model (HF Wav2Vec2's check of its
    labels) was reported at ``<string>:1`` or "an unknown location": frames of code
    generated at run time, and every frame in site-packages, were skipped."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=20,
        conv_dim=(16, 16),
        conv_kernel=(10, 3),
        conv_stride=(5, 2),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
        mask_time_prob=0.0,
        layerdrop=0.0,
        pad_token_id=0,
    )
    model = transformers.Wav2Vec2ForCTC(config).train()
    inputs = {"input_values": torch.randn(2, 400), "labels": torch.randint(1, 20, (2, 5))}
    with pytest.raises(amp_graph.CaptureError) as info:
        amp_graph.compile(model, "autocast", BF16)(**inputs)
    assert "modeling_wav2vec2.py:" in str(info.value)
    assert "labels.max() >= self.config.vocab_size" in str(info.value)


# -- tied parameters untied after capture ------------------------------------------------------


class TiedLM(nn.Module):
    """An output layer tied to the embedding, as GPT-2's and nanoGPT's."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.fc = nn.Linear(16, 16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc(self.emb(idx))))


@pytest.mark.parametrize("untie", ["new_parameter", "new_head"])
def test_untying_a_tied_parameter_after_capture_captures_again(untie):
    """Export reads a tied tensor once, by one name: untied for fine-tuning, the graph read
    the embedding for the head (wrong logits, no gradient for the new head; a larger new
    head still gave 50 logits). Now the untie is seen and the model captured again."""
    torch.manual_seed(0)
    model = TiedLM()
    reference = copy.deepcopy(model)
    fast = amp_graph.compile(model, "autocast", BF16)
    idx = torch.randint(0, 50, (2, 6))
    for _ in range(2):  # tied as captured: one graph serves
        assert same(fast(idx), autocast(reference, idx))
    assert len(fast.graph_modules) == 1
    if untie == "new_parameter":
        weight = torch.randn(50, 16)
        model.head.weight = nn.Parameter(weight.clone())
        reference.head.weight = nn.Parameter(weight.clone())
    else:
        model.head = nn.Linear(16, 60, bias=False)
        reference.head = copy.deepcopy(model.head)
    ours, theirs = fast(idx), autocast(reference, idx)
    assert same(ours, theirs)
    ours.float().sum().backward()
    theirs.float().sum().backward()
    assert same(model.head.weight.grad, reference.head.weight.grad)
    assert same(model.emb.weight.grad, reference.emb.weight.grad)
