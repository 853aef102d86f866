"""policy="autocast" on the GPT-style decoder: every aten op runs at the dtype torch.autocast
runs it at, and fewer casts execute per forward+backward."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import amp_graph
from amp_graph.demo import models

CAST = "_to_copy"


class AtenRecorder(TorchDispatchMode):
    """Records (op, input dtypes, output dtypes) of every aten op that runs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)

        def dtypes(tree: Any) -> tuple[str, ...]:
            return tuple(str(t.dtype) for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor))

        self.ops.append((func.overloadpacket.__name__, dtypes((args, kwargs)), dtypes(out)))
        return out


def record_step(fn, inputs, autocast: bool):
    recorder = AtenRecorder()
    with recorder:
        if autocast:
            with torch.autocast("cpu", torch.bfloat16):
                loss = fn(*inputs)
        else:
            loss = fn(*inputs)
        forward = len(recorder.ops)
        loss.backward()
    return recorder.ops[:forward], recorder.ops[forward:]


# Views autograd runs around saved tensors: with saved-tensor hooks (recompute_casts) a
# saved tensor's ``detach`` moves from the forward to the backward's unpacking, and a saved
# view of a recomputed cast is rebuilt by ``as_strided``. They allocate and compute nothing.
ALIASES = ("detach", "as_strided")
# Each consumer of a shared cast reads it through ``cast_read``, an ``alias`` of the copy.
READ = "alias"


def _shared_activation_casts(compiled) -> tuple[int, int]:
    """(casts amp_graph shares among several consumers of an activation, the reads of them
    beyond the first: the casts torch.autocast makes and amp_graph does not)."""
    shared = [
        n
        for n in compiled.graph.nodes
        if n.meta["amp"].role.value == "cast"
        and n.args[0].op != "get_attr"
        and len(n.meta["amp"].cast_for) > 1
    ]
    return len(shared), sum(len(n.meta["amp"].cast_for) - 1 for n in shared)


@pytest.mark.parametrize("recompute", [False, True])
def test_every_aten_op_matches_autocast_and_no_more_casts_run(recompute: bool, shared_cast_way):
    """With ``recompute_casts`` off, op for op as torch.autocast, backward included; on, the
    same ops but the views around saved tensors, and backward casts again the weights it did
    not keep (tests/test_recompute_casts.py checks those casts and views are all it adds).
    Where the consumers of a shared activation cast read it, fewer casts run than under
    autocast; where they cast their own (small copies), as many."""
    model = models.GPTWithLoss(layers=2)
    idx, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    policy = dataclasses.replace(amp_graph.Policy.preset("autocast"), recompute_casts=recompute)
    compiled = amp_graph.compile(model, policy, example_inputs=(idx, targets))

    ref_fwd, ref_bwd = record_step(model, (idx, targets), autocast=True)
    model.zero_grad(set_to_none=True)
    our_fwd, our_bwd = record_step(compiled, (idx, targets), autocast=False)
    skip = (CAST, READ, *ALIASES) if recompute else (CAST, READ)

    def without(ops, names):
        return [op for op in ops if op[0] not in names]

    # forward: the same aten ops, in the same order, at the same dtypes
    assert without(our_fwd, skip) == without(ref_fwd, skip)
    shared, removed_activation_casts = _shared_activation_casts(compiled)
    reads = sum(op[0] == READ for op in our_fwd)
    if shared_cast_way == "reads":
        assert shared > 0  # the test's model shares casts: LayerNorm outputs read by Q, K, V
        assert reads == shared + removed_activation_casts  # one per consumer of a shared cast
    else:  # every consumer of a LayerNorm output casts its own, as autocast's ops do
        assert shared == reads == 0
    # backward: the same ops at the same dtypes, the gradients' casts included: the
    # consumers of a shared cast convert their gradients as autocast's casts of theirs do
    ours, theirs = Counter(without(our_bwd, skip)), Counter(without(ref_bwd, skip))
    assert ours == theirs

    fwd_casts_ours = sum(op[0] == CAST for op in our_fwd)
    fwd_casts_autocast = sum(op[0] == CAST for op in ref_fwd)
    bwd_casts_ours = sum(op[0] == CAST for op in our_bwd)
    bwd_casts_autocast = sum(op[0] == CAST for op in ref_bwd)
    # the forward casts as autocast does, less the casts its shared activation casts spare
    assert fwd_casts_autocast - fwd_casts_ours == removed_activation_casts
    if recompute:  # backward adds one per recomputed copy
        assert bwd_casts_ours > bwd_casts_autocast
        return
    assert bwd_casts_ours == bwd_casts_autocast
