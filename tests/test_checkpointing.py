"""Activation checkpointing is kept: a checkpointed block is recomputed in backward.

``torch.utils.checkpoint(block, x, use_reentrant=False)`` and HF's
``gradient_checkpointing_enable()`` are traced through by torch.export; the capture marks
the block and ``passes/checkpoints.py`` outlines it into a submodule called through
``torch.utils.checkpoint``. The oracle is torch.autocast on the same checkpointed model:
the ops autograd runs in backward (recomputation included) and their dtypes must be the
ones CPU autocast runs (``policy="autocast"``), and the gradients must equal its own.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn as nn
from graph_helpers import TrainGraph
from hf_configs import small_llama_config
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import amp_graph

BF16 = torch.bfloat16
# casts differ by design (amp_graph casts a value once where autocast casts per use);
# detach and alias ops are bookkeeping of autograd and checkpoint
# casts and views; as_strided rebuilds a saved view of a cast backward makes again
# (recompute_casts: tests/test_recompute_casts.py counts what it adds)
_IGNORED = (
    "aten._to_copy",
    "aten.detach",
    "aten.alias",
    "aten.t.",
    "aten.view",
    "aten.as_strided",
    "prim.",
)


class OpRecorder(TorchDispatchMode):
    """The aten ops run while active, with their output dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, torch.dtype | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((str(func), getattr(out, "dtype", None)))
        return out

    def counted(self) -> collections.Counter:
        return collections.Counter(op for op in self.ops if not op[0].startswith(_IGNORED))


class Block(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.softmax(self.up(self.norm(x)), -1))


class Checkpointed(nn.Module):
    """Blocks each run through torch.utils.checkpoint (non-reentrant), as people write it."""

    def __init__(self, blocks: int = 2, reentrant: bool = False, use: bool = True) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(16, 4)
        self.reentrant, self.use = reentrant, use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant) if self.use else block(x)
        return self.head(x)


def backward_ops(step) -> tuple[collections.Counter, collections.Counter]:
    """(forward ops, backward ops) of ``step()``, which returns the loss."""
    forward = OpRecorder()
    with forward:
        loss = step()
    backward = OpRecorder()
    with backward:
        loss.backward()
    return forward.counted(), backward.counted()


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _sum_dtype_free(ops: collections.Counter) -> collections.Counter:
    """The ops, with the dtype of gradient sums (``add``) dropped: where one cast feeds
    several consumers, autograd sums their gradients in the low dtype, where torch.autocast,
    casting per use, sums them in float32 (README, "Known limits")."""
    out: collections.Counter = collections.Counter()
    for (op, dtype), count in ops.items():
        out[(op, None if op == "aten.add.Tensor" else dtype)] += count
    return out


def _compare_with_autocast(
    model: nn.Module, run, inputs: tuple, exact: bool = True
) -> collections.Counter:
    """Backward ops and gradients of amp_graph (policy autocast) against torch.autocast;
    ``exact=False``: gradient sums may differ in dtype, and so may the gradients (the
    caller compares them with amp_graph's own, without checkpointing)."""
    compiled = amp_graph.compile(model, "autocast", BF16, example_inputs=inputs)

    def ours():
        return run(compiled, inputs).float().sum()

    def theirs():
        with torch.autocast("cpu", BF16):
            return run(model, inputs).float().sum()

    model.zero_grad(set_to_none=True)
    ref_forward, ref_backward = backward_ops(theirs)
    ref_grads = _grads(model)
    model.zero_grad(set_to_none=True)
    our_forward, our_backward = backward_ops(ours)
    if not exact:
        our_backward, ref_backward = _sum_dtype_free(our_backward), _sum_dtype_free(ref_backward)
    assert our_backward == ref_backward, (
        f"backward ops differ from torch.autocast's:\n ours - theirs: "
        f"{our_backward - ref_backward}\n theirs - ours: {ref_backward - our_backward}"
    )
    if exact:  # HF's eager mask code skips building a mask that export's trace builds
        assert our_forward == ref_forward
        for ours_grad, ref_grad in zip(_grads(model), ref_grads, strict=True):
            torch.testing.assert_close(ours_grad, ref_grad, rtol=0, atol=0)
    return our_backward


def _call(model, inputs):
    return model(*inputs)


def _softmax_runs(ops: collections.Counter) -> int:
    return sum(n for (op, _), n in ops.items() if op == "aten._softmax.default")


def test_checkpointed_blocks_are_recomputed_as_torch_autocast_recomputes() -> None:
    torch.manual_seed(0)
    model = Checkpointed()
    backward = _compare_with_autocast(model, _call, (torch.randn(3, 5, 16),))
    assert _softmax_runs(backward) == 2  # each block's forward, again in backward


def test_without_checkpointing_nothing_is_recomputed() -> None:
    torch.manual_seed(0)
    model = Checkpointed(use=False)
    backward = _compare_with_autocast(model, _call, (torch.randn(3, 5, 16),))
    assert _softmax_runs(backward) == 0


def test_the_printed_graph_shows_the_checkpoint_calls() -> None:
    torch.manual_seed(0)
    compiled = amp_graph.compile(
        Checkpointed(blocks=3), "O1", BF16, example_inputs=(torch.randn(2, 16),)
    )
    code = compiled.graph_module.code
    assert code.count("torch.utils.checkpoint.checkpoint(") == 3
    assert "use_reentrant = False" in code
    record = compiled.graph_module.meta["amp_graph"]
    assert record.stats["checkpoint_regions"] == 3
    # parameters stay outside, read from the model: nothing of them is copied
    region = compiled.graph_module.checkpoint_0
    assert not [n for n in region.graph.nodes if n.op == "get_attr"]


def test_reentrant_checkpoint_is_refused_with_what_to_do() -> None:
    model = Checkpointed(reentrant=True)
    with pytest.raises(amp_graph.CaptureError, match="use_reentrant=False"):
        amp_graph.compile(model, "O1", BF16, example_inputs=(torch.randn(2, 16),))


def _hf(name: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    small = dict(vocab_size=100, use_cache=False)
    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(
            n_positions=32,
            n_embd=32,
            n_layer=2,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **small,
        )
        config._attn_implementation = "eager"  # softmax is an op of its own
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = small_llama_config()
        config._attn_implementation = "eager"
        model = transformers.LlamaForCausalLM(config)
    model.gradient_checkpointing_enable()
    return model.train()


def _hf_call(model, inputs):
    return model(inputs[0]).logits  # input_ids, positionally as captured


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hf_gradient_checkpointing_is_recomputed_as_torch_autocast_recomputes(name: str):
    model = _hf(name)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    backward = _compare_with_autocast(model, _hf_call, (ids,), exact=False)
    assert _softmax_runs(backward) == 2  # two layers' attention, recomputed
    # recomputation changes no number: the gradients equal those without checkpointing
    checkpointed = _grads(model)
    model.gradient_checkpointing_disable()
    model.zero_grad(set_to_none=True)
    compiled = amp_graph.compile(model, "autocast", BF16, example_inputs=(ids,))
    _hf_call(compiled, (ids,)).float().sum().backward()
    for with_it, without in zip(checkpointed, _grads(model), strict=True):
        torch.testing.assert_close(with_it, without, rtol=0, atol=0)


def test_graph_recomputes_checkpointed_blocks() -> None:
    def softmax_per_step(use: bool) -> int:
        torch.manual_seed(0)
        model = Checkpointed(use=use)
        graph = TrainGraph(model, torch.optim.SGD(model.parameters(), lr=0.1), dtype=BF16)
        x, y = torch.randn(3, 16), torch.tensor([0, 1, 3])
        graph(x, y)  # captured and compiled
        recorder = OpRecorder()
        with recorder:
            graph(x, y)
        return _softmax_runs(recorder.counted())

    assert softmax_per_step(use=False) == 2
    assert softmax_per_step(use=True) == 4  # forward, and again in backward


def test_report_explain_and_numerics_see_a_checkpointed_block() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 16)
    compiled = amp_graph.compile(Checkpointed(), "O1", BF16, example_inputs=(x,))
    report = amp_graph.report(compiled)
    assert report.row("checkpoint").op == "checkpoint"
    assert "recomputed in backward" in amp_graph.explain(compiled, "checkpoint")
    numbers = amp_graph.numerics(compiled, x, backward=True, loss_fn=lambda out: out.sum())
    assert numbers.first_nonfinite is None
    assert 0 < numbers.output_error < 1e-2
