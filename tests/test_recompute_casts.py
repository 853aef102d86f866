"""Backward casts again what it can, instead of keeping it (passes/recompute_casts.py,
amp_graph/ops/recompute_ops.py): less held from forward to backward, the same gradients, bit for
bit.

What the forward leaves alive is counted by :class:`amp_graph.inspect.held.HeldForBackward`:
every tensor an aten op made, weakly referenced from a dispatch mode, by distinct live
storage once the forward returns, parameters left out. It sees what a checkpoint or any
cache keeps, not only what saved-tensor hooks see. Each test compares the same policy with
``recompute_casts`` on and off (and torch.autocast), on the same model and batch.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint
from dispatch_helpers import CountOps

import amp_graph
from amp_graph.demo.models import GPT
from amp_graph.inspect.held import held_for_backward
from amp_graph.ops.recompute_ops import ModifiedSourceError, recomputed_cast, recomputed_quantize

BF16 = torch.bfloat16


def policy(name: str, recompute: bool) -> amp_graph.Policy:
    return dataclasses.replace(amp_graph.Policy.preset(name), recompute_casts=recompute)


def step(model: nn.Module, forward: Callable[[], torch.Tensor]) -> tuple[int, list[torch.Tensor]]:
    """Bytes the forward leaves alive for backward (parameters and buffers aside), and the
    gradients after backward."""
    model.zero_grad(set_to_none=True)
    held, out = held_for_backward(forward, [*model.parameters(), *model.buffers()])
    out.float().square().mean().backward()
    return held, [p.grad.clone() for p in model.parameters() if p.grad is not None]


def assert_same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) and a
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def compare(
    model: nn.Module, call: Callable[[nn.Module], torch.Tensor], name: str
) -> dict[str, int]:
    """Held bytes with the recompute on, off, and under torch.autocast; asserts the
    gradients of on and off are the same bits."""
    held, grads = {}, {}
    for recompute in (True, False):
        compiled = amp_graph.compile(model, policy(name, recompute), BF16)
        step(model, lambda c=compiled: call(c))  # capture; then measure a second call
        held[str(recompute)], grads[recompute] = step(model, lambda c=compiled: call(c))
        if recompute:
            assert compiled.graph_module.meta["amp_graph"].stats["casts_recomputed"] > 0

    def autocast() -> torch.Tensor:
        with torch.autocast("cpu", BF16):
            return call(model)

    held["autocast"], _ = step(model, autocast)
    assert_same_bits(grads[True], grads[False])
    return held


def llama(checkpointing: bool = False) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=256,
        max_position_embeddings=64,
        use_cache=False,
    )
    config._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(config).train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model


IDS = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0))
LLAMA_IDS = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", ["O1", "autocast"])
def test_gpt_keeps_no_weight_copy_and_computes_the_same_gradients(name: str) -> None:
    model = GPT(vocab=64, block=32, dim=64, heads=4, layers=2)
    held = compare(model, lambda m: m(IDS), name)
    # what is no longer held is the weights' bf16 copies: the linears' (q, k, v, proj, fc,
    # out) weights of 2 blocks are 12 * 64 * 64 * ... bytes; at least half of them
    weights = sum(p.numel() for n, p in model.named_parameters() if "blocks" in n and p.dim() == 2)
    assert held["False"] - held["True"] >= weights * 2 // 2
    assert held["True"] < held["autocast"]


@pytest.mark.parametrize("name", ["O1", "autocast"])
def test_hf_llama_holds_less_than_autocast(name: str) -> None:
    model = llama()
    held = compare(model, lambda m: m(LLAMA_IDS).logits, name)
    assert held["True"] < held["False"] and held["True"] < held["autocast"]


def test_hf_gradient_checkpointing_composes() -> None:
    """HF's checkpoints recompute their blocks (they keep their inputs only); the casts
    outside them (the head's weight) are still not kept, and nothing more is."""
    model = llama(checkpointing=True)
    held = compare(model, lambda m: m(LLAMA_IDS).logits, "O1")
    assert held["True"] <= held["False"] and held["True"] < held["autocast"]


class CheckpointedGPT(nn.Module):
    """The GPT with each block under ``torch.utils.checkpoint`` (as nanoGPT forks do)."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT(vocab=64, block=32, dim=64, heads=4, layers=2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        g = self.gpt
        x = g.tok(idx) + g.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in g.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return g.head(g.ln_f(x))


def test_the_models_own_checkpoints_compose() -> None:
    model = CheckpointedGPT()
    held = compare(model, lambda m: m(IDS), "O1")
    compiled = amp_graph.compile(model, policy("O1", True), BF16)
    compiled(IDS)
    code = compiled.code
    assert "checkpoint" in code and "recomputed_cast" in code
    assert held["True"] <= held["False"] < held["autocast"] + 1


def is_alias(op_name: str) -> bool:
    """An aten op whose every overload returns a view of its input: no memory, no kernel."""
    packet = getattr(torch.ops.aten, op_name)
    return all(
        packet.overloads()
        and all(r.alias_info is not None for r in getattr(packet, o)._schema.returns)
        for o in packet.overloads()
    )


def _backward_cases() -> dict[str, tuple[Callable[[], nn.Module], Callable, str]]:
    return {  # the weights' copies; widened activations (pow's input; Llama's RMSNorm)
        "gpt": (lambda: GPT(vocab=64, block=32, dim=64, heads=4, layers=2), lambda m: m(IDS), "O1"),
        "widened": (_WidenedForPow, lambda m: m(torch.randn(8, 16)), "O1"),
        "llama_o2": (llama, lambda m: m(LLAMA_IDS).logits, "O2"),
    }


@pytest.mark.parametrize("case", ["gpt", "widened", "llama_o2"])
def test_backward_runs_no_extra_op_but_casts(case: str) -> None:
    """Against the same policy without the recompute: backward adds casts (``_to_copy``)
    and views (``as_strided`` rebuilds a saved ``weight.t()``; autograd unpacks what
    saved-tensor hooks kept with a ``detach``), nothing else."""
    make, call, name = _backward_cases()[case]
    model = make()
    counts = {}
    for recompute in (True, False):
        compiled = amp_graph.compile(model, policy(name, recompute), BF16)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        loss = call(compiled).float().square().mean()
        with CountOps() as mode:
            loss.backward()
        counts[recompute] = mode.ops
    extra = counts[True] - counts[False]
    assert extra["_to_copy"] > 0
    assert all(is_alias(op) for op in set(extra) - {"_to_copy"}), extra
    assert not counts[False] - counts[True]


def test_a_source_written_before_backward_is_an_error() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    compiled = amp_graph.compile(model, policy("O1", True), BF16)
    out = compiled(torch.randn(4, 8, requires_grad=True))
    with torch.no_grad():
        model[2].weight.add_(1.0)
    with pytest.raises(ModifiedSourceError, match="recompute_casts=False"):
        out.float().sum().backward()


def test_outer_saved_tensor_hooks_decide_and_gradients_stay() -> None:
    """Inside someone's saved-tensor hooks (``save_on_cpu``) amp_graph's stay off."""
    model = GPT(vocab=64, block=32, dim=64, heads=4, layers=2)
    compiled = amp_graph.compile(model, "O1", BF16)
    _, plain = step(model, lambda: compiled(IDS))
    packed = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, hooked = step(model, lambda: compiled(IDS))
    assert BF16 in packed  # the weight copies reached the outer hooks, kept as they are
    assert_same_bits(plain, hooked)


def test_report_and_explain_say_what_is_recomputed() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.Softmax(-1), nn.Linear(16, 8))
    compiled = amp_graph.compile(
        model, policy("O1", True), BF16, example_inputs=(torch.randn(4, 8),)
    )
    report = amp_graph.report(compiled)
    assert report.casts_recomputed == 5  # two weights, two biases, softmax's output
    assert report.recomputed_cast_bytes == (8 * 16 + 16 + 16 * 8 + 8 + 4 * 16) * 2
    assert report.casts_absorbed == 1  # softmax widens its input itself (dtype=)
    assert "recomputed in backward" in report.totals()
    cast = next(n for n in compiled.graph.nodes if n.target is recomputed_cast)
    text = str(amp_graph.explain(compiled, cast.name))
    assert "not kept for backward" in text and "parameter" in text
    off = amp_graph.compile(model, policy("O1", False), BF16, example_inputs=(torch.randn(4, 8),))
    assert amp_graph.report(off).casts_recomputed == 0
    assert "recomputed_cast" not in off.code


def test_softmax_output_cast_is_recomputed_from_the_kept_float32_result() -> None:
    """O1 computes softmax in float32 and casts its output for the next matmul: backward
    keeps the float32 probabilities anyway, so not also their bf16 copy."""

    class Attention(nn.Module):
        def forward(self, q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return torch.softmax(q @ q.transpose(-1, -2), -1) @ v

    q = torch.randn(2, 16, 8, requires_grad=True)
    v = torch.randn(2, 16, 8, requires_grad=True)
    held, grads = {}, {}
    for recompute in (True, False):
        compiled = amp_graph.compile(Attention(), policy("O1", recompute), BF16)
        q.grad = v.grad = None
        held[recompute], out = held_for_backward(lambda c=compiled: c(q, v))
        out.float().sum().backward()
        grads[recompute] = [q.grad.clone(), v.grad.clone()]
        kept = [n.args[2] for n in compiled.graph.nodes if n.target is recomputed_cast]
        assert kept == (["autograd"] if recompute else [])
    assert held[False] - held[True] == 2 * 16 * 16 * 2  # the bf16 probabilities
    assert_same_bits(grads[True], grads[False])


def test_a_policy_field_of_the_wrong_type_is_named() -> None:
    with pytest.raises(ValueError, match="recompute_casts"):
        dataclasses.replace(amp_graph.Policy.preset("O1"), recompute_casts="no")
    with pytest.raises(ValueError, match="cast_inputs"):
        dataclasses.replace(amp_graph.Policy.preset("O1"), cast_inputs=1)


# ---- the other entry points: the backend, Graph (accumulation, O2, enable_compile), fp8 ----


@pytest.mark.parametrize("inner", ["eager", "aot_eager", "inductor"])
def test_backend_gradients_are_the_same_bits(inner: str, fresh_dynamo: None) -> None:
    """(Dynamo runs no compiled code under a dispatch mode, so what the forward holds is not
    counted here; the casts backward runs are.)"""
    model = GPT(vocab=64, block=32, dim=64, heads=4, layers=1)
    casts, grads = {}, {}
    for recompute in (True, False):
        torch._dynamo.reset()
        backend = amp_graph.backend(policy("O1", recompute), BF16, inner=inner)
        compiled = torch.compile(model, backend=backend)
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            loss = compiled(IDS).float().square().mean()
            with CountOps() as mode:
                loss.backward()
        casts[recompute] = mode.ops["_to_copy"] + mode.ops["convert_element_type"]
        grads[recompute] = [p.grad.clone() for p in model.parameters()]
        [gm] = amp_graph.captured_graphs(compiled)
        assert (gm.meta["amp_graph"].stats["casts_recomputed"] > 0) == recompute
    assert_same_bits(grads[True], grads[False])
    if inner != "inductor":  # inductor's backward is one kernel: no op to count
        # eager: amp_graph's hooks; aot_eager: AOTAutograd's partitioner, told by the
        # activation-checkpointing tags the pass puts on the casts (meta["recompute"])
        assert casts[True] > casts[False]


def train_graph(
    name: str, recompute: bool, micro_batches: int = 1, compile_build: bool = False
) -> tuple[list[torch.Tensor], amp_graph.Graph]:
    torch.manual_seed(0)
    model = GPT(vocab=64, block=32, dim=64, heads=4, layers=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    class Train(amp_graph.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.config.enable_amp(True, policy=policy(name, recompute), dtype=BF16)
            self.config.set_gradient_accumulation_steps(micro_batches)
            if compile_build:
                self.config.enable_compile(backend="aot_eager")

        def build(self, idx: torch.Tensor) -> torch.Tensor:
            loss = model(idx).float().square().mean()
            loss.backward()
            return loss

    graph = Train()
    for i in range(2):
        graph(torch.roll(IDS, i))
    return [p.detach().float().clone() for p in model.parameters()], graph


@pytest.mark.parametrize(
    ("name", "micro_batches", "compile_build"),
    [("O1", 1, False), ("O1", 4, False), ("O2", 1, False), ("O1", 1, True)],
)
def test_graph_trains_the_same_bits(name: str, micro_batches: int, compile_build: bool) -> None:
    on, graph = train_graph(name, True, micro_batches, compile_build)
    off, _ = train_graph(name, False, micro_batches, compile_build)
    assert_same_bits(on, off)
    recomputed = graph.build_graph.meta["amp_graph"].stats["casts_recomputed"]
    if name == "O1" and micro_batches == 1:  # O2 stores weights low; accumulation hoists
        assert recomputed > 0 and "recomputed_cast" in graph.build_graph.code


def test_fp8_policy_trains_the_same_bits() -> None:
    from amp_graph.ops.fp8_ops import fp8_matmul_error

    if fp8_matmul_error("cpu") is not None:
        pytest.skip(f"no fp8 matmul here: {fp8_matmul_error('cpu')}")
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 32))
    x = torch.randn(16, 32)
    held, grads = {}, {}
    for recompute in (True, False):
        compiled = amp_graph.compile(model, policy("fp8", recompute), BF16)
        step(model, lambda c=compiled: c(x))  # capture
        held[recompute], grads[recompute] = step(model, lambda c=compiled: c(x))
        quantized = [n for n in compiled.graph.nodes if n.target is recomputed_quantize]
        assert len(quantized) == (2 if recompute else 0)  # the two weights' e4m3 copies
    assert_same_bits(grads[True], grads[False])
    # the weights' e4m3 copies (one byte per element), and layer_norm's float32 input: its
    # bf16 source (GELU's output) kept in its place, 2 bytes per element instead of 4
    assert held[False] - held[True] == 32 * 64 + 64 * 32 + 16 * 64 * (4 - 2)


def test_every_linear_weight_cast_is_recomputed_in_the_printed_graph() -> None:
    model = GPT(vocab=64, block=32, dim=64, heads=4, layers=1)
    compiled = amp_graph.compile(model, policy("O1", True), BF16, example_inputs=(IDS,))
    casts = [n for n in compiled.graph.nodes if n.target is recomputed_cast]
    assert all(n.args[0].op == "get_attr" and n.args[2] == "module" for n in casts)
    sources = {n.args[0].target.removeprefix("model.") for n in casts}
    linears = {f"{path}.weight" for path, m in model.named_modules() if isinstance(m, nn.Linear)}
    linears = {"tok.weight" if p == "head.weight" else p for p in linears}  # tied
    assert linears <= sources
    assert compiled.code.count("recomputed_cast(") == len(casts)


def _native_bf16_cpu() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _zoo() -> list[Any]:
    from test_front_end import MODELS

    cases = []
    for name, case in MODELS.items():
        marks = []
        if name == "lstm" and not _native_bf16_cpu():
            marks = [pytest.mark.skip(reason="oneDNN has no bf16 LSTM without AVX512-BF16/AMX")]
        cases.append(pytest.param(name, case, marks=marks, id=name))
    return cases


@pytest.mark.parametrize("policy_name", ["O1", "autocast"])
@pytest.mark.parametrize(("name", "case"), _zoo())
def test_zoo_gradients_are_the_same_bits(name: str, case: tuple, policy_name: str) -> None:
    """Every model of the front-end zoo: the gradients with the recompute on and off are the
    same bits (a cast is deterministic), whatever backward does not keep."""
    make, inputs, loss_of = case
    grads = {}
    for recompute in (True, False):
        torch.manual_seed(0)
        model = make().train()
        args = inputs()
        compiled = amp_graph.compile(model, policy(policy_name, recompute), BF16)
        for _ in range(2):  # capture, then the measured call
            model.zero_grad(set_to_none=True)
            loss_of(compiled(*args)).float().backward()
        grads[recompute] = [
            p.grad.clone() if p.grad is not None else None for p in model.parameters()
        ]
    assert any(g is not None for g in grads[True])
    for on, off in zip(grads[True], grads[False], strict=True):
        assert (on is None) == (off is None)
        if on is not None:
            assert torch.equal(on, off)


def test_a_saved_tensor_written_in_place_is_still_an_error() -> None:
    """Autograd checks no version of what saved-tensor hooks return: amp_graph's hooks check
    it themselves, so a model that writes a saved value in place fails as without them."""

    class WritesSaved(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.sigmoid(self.fc(x).float())  # sigmoid saves its result
            out = h * 2
            h.mul_(3)  # ... which is written afterwards
            return out

    for recompute in (True, False):
        compiled = amp_graph.compile(WritesSaved(), policy("O1", recompute), BF16)
        out = compiled(torch.randn(4, 8))
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


def test_inductor_saves_the_parameters_not_their_copies(fresh_dynamo: None) -> None:
    """Where AOTAutograd compiles the graph, the pass's activation-checkpointing tags make its
    partitioner save the float32 parameters (alive anyway: no bytes) and cast them again in
    backward, where it saved their bf16 copies before, as torch.compile under autocast does."""
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    x = torch.randn(8, 64, requires_grad=True)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters() if p.dim() == 2}
    shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    shapes |= {s[::-1] for s in shapes}
    for recompute in (True, False):
        torch._dynamo.reset()
        backend = amp_graph.backend(policy("O1", recompute), BF16, inner="inductor")
        saved = torch.compile(model, backend=backend)(x).grad_fn.saved_tensors
        copies = [t for t in saved if t.dtype == BF16 and tuple(t.shape) in shapes]
        kept = {t.untyped_storage().data_ptr() for t in saved} & weights
        assert (len(copies), len(kept)) == ((0, 2) if recompute else (2, 0))


def test_graph_enable_compile_saves_the_parameters_not_their_copies(fresh_dynamo: None) -> None:
    """Graph's enable_compile hands the build graph to torch.compile, whose dynamo retraces
    it: there each recomputed cast is a region of torch's activation checkpointing, which
    AOTAutograd recomputes in backward."""
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters() if p.dim() == 2}
    x = torch.randn(8, 64)
    for recompute in (True, False):
        torch._dynamo.reset()

        class Train(amp_graph.Graph):
            def __init__(self, chosen: amp_graph.Policy) -> None:
                super().__init__()
                self.model = model
                self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
                self.config.enable_amp(True, policy=chosen, dtype=BF16)
                self.config.enable_compile(backend="inductor")

            def build(self, x: torch.Tensor) -> torch.Tensor:
                loss = self.model(x).float().square().mean()
                loss.backward()
                return loss

        graph = Train(policy("O1", recompute))
        graph(x)
        loss = graph.step_graph.get_submodule("build")(x)[0]  # the compiled build: its loss
        saved = loss.grad_fn.saved_tensors
        copies = [t for t in saved if t.dtype == BF16 and tuple(t.shape) in {(256, 64), (64, 256)}]
        kept = {t.untyped_storage().data_ptr() for t in saved} & weights
        # the first linear's weight gradient needs no input gradient: its copy was never saved
        assert (len(copies), len(kept)) == ((0, 1) if recompute else (1, 0))


def test_a_models_own_cast_of_a_kept_value_is_recomputed() -> None:
    """HF GPT-2's eager attention casts its float32 probabilities (O1: softmax in float32)
    back with ``attn_weights.type(value.dtype)``; softmax's backward keeps the float32
    probabilities, so backward casts again instead of keeping the bf16 copy too."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_positions=32, n_embd=64, n_layer=2, n_head=4, vocab_size=128, use_cache=False
    )
    config.attn_pdrop = config.resid_pdrop = config.embd_pdrop = 0.0
    config._attn_implementation = "eager"
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 128, (2, 32))
    held = compare(model, lambda m: m(ids).logits, "O1")
    compiled = amp_graph.compile(model, policy("O1", True), BF16, example_inputs=(ids,))
    model_casts = [
        n
        for n in compiled.graph.nodes
        if n.meta["amp"].role.value == "user_cast" and n.target is recomputed_cast
    ]
    assert [n.args[2] for n in model_casts] == ["autograd", "autograd"]  # one per layer
    assert all("softmax" in n.args[0].name for n in model_casts)
    assert "not kept for backward" in str(amp_graph.explain(compiled, model_casts[0].name))
    assert held["True"] < held["False"]


def test_graph_build_holds_less_for_backward() -> None:
    """Graph's build graph (one micro-batch), called as the step graph calls it: what its
    forward leaves for the step's backward, recomputing against keeping. (With gradient
    accumulation the step casts each weight once for all micro-batches and keeps those
    copies through the step: the hoisted casts are not recomputed, by design.)"""
    held = {}
    for recompute in (True, False):
        _, graph = train_graph("O1", recompute)
        build = graph.step_graph.get_submodule("build")
        model = graph.model
        held[recompute], _ = held_for_backward(
            lambda b=build: b(IDS)[0], [*model.parameters(), *model.buffers()]
        )
    assert held[True] < held[False]


class _WidenedForPow(nn.Module):
    """O1 computes ``pow`` in float32 (torch.autocast's CUDA list): it widens the linear's
    bf16 output, and pow's backward saves the float32 copy."""

    def __init__(self, width: int = 64, sliced: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(16, width)
        self.sliced = sliced

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return torch.pow(h[:, :2] if self.sliced else h, 3)


def _held_on_and_off(model: nn.Module, x: torch.Tensor, name: str = "O1") -> dict[bool, int]:
    held, grads = {}, {}
    for recompute in (True, False):
        compiled = amp_graph.compile(model, policy(name, recompute), BF16)
        step(model, lambda c=compiled: c(x))  # capture
        held[recompute], grads[recompute] = step(model, lambda c=compiled: c(x))
        kept = [n.args[2] for n in compiled.graph.nodes if n.target is recomputed_cast]
        assert ("smaller" in kept) == recompute
    assert_same_bits(grads[True], grads[False])
    return held


def test_a_widened_activation_is_held_once_in_its_low_dtype() -> None:
    """Backward keeps the bf16 source of pow's float32 input in its place: exactly half the
    copy's bytes less, the same gradients, and explain says so."""
    x = torch.randn(8, 16)
    held = _held_on_and_off(_WidenedForPow(), x)
    assert held[False] - held[True] == 8 * 64 * (4 - 2)
    compiled = amp_graph.compile(_WidenedForPow(), policy("O1", True), BF16, example_inputs=(x,))
    widened = next(
        n for n in compiled.graph.nodes if n.target is recomputed_cast and n.args[2] == "smaller"
    )
    assert widened.args[1] is torch.float32 and widened.args[0].meta["val"].dtype is BF16
    text = str(amp_graph.explain(compiled, widened.name))
    assert "narrower source" in text and "not held twice" in text


def test_a_widened_view_of_a_larger_tensor_is_kept_as_the_copy() -> None:
    """A slice keeps its whole base alive: where the source's storage is not smaller than
    the copy, backward keeps the copy, as before (nothing more is held)."""
    held = _held_on_and_off(_WidenedForPow(width=64, sliced=True), torch.randn(8, 16))
    assert held[True] == held[False]


def test_a_group_norm_after_a_convolution_holds_its_input_in_bf16() -> None:
    """diffusers' UNet under O1: every GroupNorm after a bf16 convolution saves its float32
    input; backward keeps the convolution's bf16 output in its place."""
    diffusers = pytest.importorskip("diffusers")
    unet = diffusers.UNet2DModel(
        sample_size=16,
        in_channels=3,
        out_channels=3,
        block_out_channels=(32, 64),
        layers_per_block=1,
        norm_num_groups=8,
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
    ).train()
    sample, timestep = torch.randn(2, 3, 16, 16), torch.tensor([10])

    class Call(nn.Module):  # the UNet's sample, for the shared helpers
        def __init__(self) -> None:
            super().__init__()
            self.unet = unet

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.unet(x, timestep).sample

    held = _held_on_and_off(Call(), sample)
    assert held[True] < 0.85 * held[False]


def test_llamas_own_upcast_under_o2_is_held_in_bf16() -> None:
    """Under O2 Llama's residual stream is bf16, and its RMSNorm widens it on purpose
    (``hidden_states.to(torch.float32)``), then saves the float32 copy for ``pow`` and the
    product: backward keeps the bf16 hidden states instead."""
    model = llama()
    held, grads, kinds = {}, {}, {}
    for recompute in (True, False):
        compiled = amp_graph.compile(model, policy("O2", recompute), BF16)
        step(model, lambda c=compiled: c(LLAMA_IDS).logits)
        held[recompute], grads[recompute] = step(model, lambda c=compiled: c(LLAMA_IDS).logits)
        kinds[recompute] = Counter(
            n.args[2]
            for n in compiled.graph.nodes
            if n.target is recomputed_cast and n.meta["amp"].role.value == "user_cast"
        )
    assert kinds[True]["smaller"] >= 5  # two norms per layer, and the final norm
    assert held[True] < held[False]
    assert_same_bits(grads[True], grads[False])


class _MicroBatches(amp_graph.Graph):
    """A Graph of 4 micro-batches per step over ``_WidenedForPow``."""

    def __init__(self, recompute: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = _WidenedForPow()
        self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=1e-3))
        self.config.enable_amp(True, policy=policy("O1", recompute), dtype=BF16)
        self.config.set_gradient_accumulation_steps(4)

    def build(self, x: torch.Tensor) -> torch.Tensor:
        loss = self.model(x).float().square().mean()
        loss.backward()
        return loss


def test_graph_with_micro_batches_holds_a_widened_activation_narrow() -> None:
    """Under ``Graph`` with 4 micro-batches the step casts each weight once for all of them
    (hoisted, held through the step by design); what one micro-batch's forward leaves for
    its backward still holds a widened activation in bf16, not float32."""
    held, x = {}, torch.randn(16, 16)
    for recompute in (True, False):
        graph = _MicroBatches(recompute)
        graph(x)
        hoist = next(n for n in graph.step_graph.graph.nodes if n.name == "low_precision_weights")
        build = graph.step_graph.get_submodule("build")
        weights = hoist.target(build, *hoist.args[1:])  # the step's weight copies
        kept = [*graph.model.parameters(), *graph.model.buffers(), *weights]
        held[recompute], _ = held_for_backward(lambda b=build, w=weights: b(x[:4], w), kept)
        assert ("smaller" in build.code) == recompute
    assert held[False] - held[True] == 4 * 64 * (4 - 2)


class _Tagged(torch.Tensor):
    """A plain tensor subclass (``__torch_function__`` keeps it through every op)."""


def test_a_widened_subclass_is_never_kept_in_its_copys_place() -> None:
    """A tensor subclass's storage may be elsewhere, or none (a wrapper such as DTensor):
    its widened copy is kept as before; a plain tensor's source is kept where smaller."""
    from amp_graph.ops.recompute_ops import _smaller_storage

    source = torch.randn(8, 16, dtype=BF16)
    assert _smaller_storage(source, source.float())
    tagged = source.as_subclass(_Tagged)
    assert not _smaller_storage(tagged, tagged.float())
    held = _held_on_and_off(_WidenedForPow(), torch.randn(8, 16).as_subclass(_Tagged))
    assert held[True] == held[False]  # and the gradients are the same bits


class _WrittenAroundTheCast(nn.Module):
    """The linear's bf16 output written in place before pow's widening cast reads it (as
    BERT's ``embeddings += position_embeddings`` before its LayerNorm), or after."""

    def __init__(self, after: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 64)
        self.after = after

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if not self.after:
            h.mul_(2.0)
        y = torch.pow(h, 3)
        if self.after:
            h.mul_(2.0)  # the source changes after the cast read it: the copy must be kept
        return y + h.float().sum()


@pytest.mark.parametrize("after", [False, True], ids=["written_before", "written_after"])
def test_a_source_written_in_place_is_recast_only_if_written_before_the_cast(after: bool):
    model, x = _WrittenAroundTheCast(after), torch.randn(8, 16)
    grads = {}
    for recompute in (True, False):
        compiled = amp_graph.compile(model, policy("O1", recompute), BF16, example_inputs=(x,))
        pow_input = next(n for n in compiled.graph.nodes if "pow" in n.name).args[0]
        decided = pow_input.target is recomputed_cast
        assert decided == (recompute and not after)
        _, grads[recompute] = step(model, lambda c=compiled: c(x))  # no ModifiedSourceError
    assert_same_bits(grads[True], grads[False])


class _BufferScaledBeforeUse(nn.Module):
    """A buffer written in place before its cast reads it: the next call writes it again."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("mix", torch.eye(8) + 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mix.diagonal().mul_(1.01)  # through a view: the cast then reads the buffer
        return self.fc(x) @ self.mix


def test_a_buffer_the_graph_writes_is_never_recast_even_if_written_before_the_read():
    """Two calls, then one backward (the second call's write comes before the first
    call's backward): the buffer's copy is kept, so no ModifiedSourceError, and the
    gradients are those of the casts kept."""
    grads = {}
    for recompute in (True, False):
        torch.manual_seed(0)
        model, x = _BufferScaledBeforeUse(), torch.randn(4, 8)
        compiled = amp_graph.compile(model, policy("O1", recompute), BF16, example_inputs=(x,))
        (mix_cast,) = [n for n in compiled.graph.nodes if n.name == "model_mix_bf16"]
        assert mix_cast.target == "to"  # kept, not a recomputed_cast
        model.mix.copy_(torch.eye(8) + 0.1)
        (compiled(x).float().sum() + compiled(x).float().sum()).backward()
        grads[recompute] = [p.grad for p in model.parameters()]
    assert_same_bits(grads[True], grads[False])
