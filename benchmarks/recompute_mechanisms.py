"""Two other mechanisms for the recompute of casts (issue 24), measured against amp_graph's.

amp_graph recomputes a decided cast through saved-tensor hooks entered for the whole
forward (:mod:`amp_graph.ops.recompute_ops`): Python runs for every tensor autograd saves. This
script builds, on the same compiled GPT, two alternatives as experiments (they patch the
graph after compilation; nothing here is part of the library) and times a forward +
backward of each against the same policy with ``recompute_casts=False``:

* **release**: no saved-tensor hooks. After the last forward use of each recomputed copy
  (through its views), the copy's storage is resized to 0; a prehook on the ``grad_fn`` of
  each op that read it refills it in place (``copy_`` from the source, the version counter
  preserved), FSDP2's trick for its unsharded parameters.
* **scoped**: amp_graph's hooks, pushed only around the ops that read a recomputed copy
  (directly or through views) instead of over the whole forward.

It first checks that each holds what amp_graph's holds for backward and gives the same
gradient bits as keeping the casts (on CUDA, where embedding and attention backward use
atomics, bit equality is not expected and is printed only).

    python benchmarks/recompute_mechanisms.py                  # GPT width 128, 4x64, CPU
    python benchmarks/recompute_mechanisms.py --dim 64 --layers 2 --batch 4 --seq 32
    python benchmarks/recompute_mechanisms.py --device cuda --dim 768 --layers 12 \\
        --heads 12 --vocab 8192 --batch 8 --seq 512 --repeats 21
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from measure import sync

import amp_graph
from amp_graph.demo import models
from amp_graph.inspect.held import held_for_backward
from amp_graph.ops import recompute_ops
from amp_graph.ops.recompute_ops import recomputed_cast


def _aliases_and_readers(cast: fx.Node) -> tuple[set[fx.Node], list[fx.Node]]:
    """The view nodes of ``cast``'s copy (itself included), and the nodes reading them."""
    aliases, readers, frontier = {cast}, [], [cast]
    while frontier:
        for user in frontier.pop().users:
            schema = getattr(user.target, "_schema", None)
            is_view = schema is not None and any(
                r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
            )
            if user.op == "call_function" and is_view:
                aliases.add(user)
                frontier.append(user)
            else:
                readers.append(user)
    return aliases, readers


# ---- release: free the copy after its forward, refill it before its readers' backward ----

_releasing = [False]


def _release(copy: torch.Tensor, source: torch.Tensor, *read: Any) -> None:
    if not _releasing[0] or copy is source:
        return
    storage = copy.untyped_storage()
    nbytes = storage.nbytes()

    def refill(grad_outputs: Any) -> None:
        if storage.nbytes() == 0:
            storage.resize_(nbytes)
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(copy):
                copy.copy_(source)

    hooked = False
    for value in read:
        grad_fn = getattr(value, "grad_fn", None)
        if grad_fn is not None:
            grad_fn.register_prehook(refill)
            hooked = True
    if hooked:
        storage.resize_(0)


def make_releasing(gm: fx.GraphModule) -> None:
    recompute_ops.uninstall(gm)
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for cast in [n for n in gm.graph.nodes if n.target is recomputed_cast]:
        aliases, readers = _aliases_and_readers(cast)
        if any(r.op == "output" for r in readers):
            continue  # the caller gets the copy
        with gm.graph.inserting_after(max([*aliases, *readers], key=order.__getitem__)):
            gm.graph.call_function(_release, (cast, cast.args[0], *readers))
    gm.recompile()

    def on(module: Any, args: Any) -> None:
        _releasing[0] = torch.is_grad_enabled()

    def off(module: Any, args: Any, output: Any) -> None:
        _releasing[0] = False

    gm.register_forward_pre_hook(on)
    gm.register_forward_hook(off)


# ---- scoped: amp_graph's hooks around the readers only -----------------------------------

_push = torch._C._autograd._push_saved_tensors_default_hooks
_pop = torch._C._autograd._pop_saved_tensors_default_hooks
_top = torch._C._autograd._top_saved_tensors_default_hooks


def _reading_recomputed(op: Callable, *args: Any) -> Any:
    if recompute_ops._recording.copies is None or _top(False) is not None:
        return op(*args)
    _push(recompute_ops._pack, recompute_ops._unpack)
    try:
        return op(*args)
    finally:
        _pop()


class _RecordingOnly(recompute_ops._RecordingCall):
    """Records the copies, enters no hooks (the readers do)."""

    def __enter__(self) -> None:
        recompute_ops._recording.copies = {}

    def __exit__(self, *exc: Any) -> None:
        recompute_ops._recording.copies = self.previous


def make_scoped(gm: fx.GraphModule) -> None:
    readers = set()
    for cast in [n for n in gm.graph.nodes if n.target is recomputed_cast]:
        readers.update(r for r in _aliases_and_readers(cast)[1] if r.op == "call_function")
    for reader in readers:
        reader.args, reader.target = (reader.target, *reader.args), _reading_recomputed
    gm.recompile()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in [("dim", 128), ("layers", 4), ("heads", 4), ("vocab", 512)]:
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=61)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    torch.manual_seed(0)
    gpt = models.GPT(
        vocab=args.vocab, block=args.seq, dim=args.dim, heads=args.heads, layers=args.layers
    ).to(args.device)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device)
    keeping = dataclasses.replace(amp_graph.Policy.preset("O1"), recompute_casts=False)
    compiled = {
        "keeping": amp_graph.compile(gpt, keeping, torch.bfloat16, mode="eager"),
        "hooks (amp_graph's)": amp_graph.compile(gpt, "O1", torch.bfloat16, mode="eager"),
        "release": amp_graph.compile(gpt, "O1", torch.bfloat16, mode="eager"),
        "scoped": amp_graph.compile(gpt, "O1", torch.bfloat16, mode="eager"),
    }

    def step(name: str) -> torch.Tensor:
        recompute_ops._RecordingCall = _RecordingOnly if name == "scoped" else original
        gpt.zero_grad(set_to_none=True)
        loss = compiled[name](ids).float().square().mean()
        loss.backward()
        return loss

    original = recompute_ops._RecordingCall
    try:
        for name in compiled:
            step(name)  # capture
        make_releasing(compiled["release"].graph_module)
        make_scoped(compiled["scoped"].graph_module)
        print(f"torch {torch.__version__}, {args.device}, GPT {vars(args)}")
        grads = {}
        for name, module in compiled.items():
            recompute_ops._RecordingCall = _RecordingOnly if name == "scoped" else original
            gpt.zero_grad(set_to_none=True)
            held, out = held_for_backward(lambda m=module: m(ids), [*gpt.parameters()])
            out.float().square().mean().backward()
            grads[name] = [p.grad.clone() for p in gpt.parameters()]
            same = all(map(torch.equal, grads["keeping"], grads[name]))
            print(f"  {name:20s} held {held / 1e6:8.2f} MB; gradients = keeping's: {same}")
        times: dict[str, list[float]] = {name: [] for name in compiled}
        names = list(compiled)
        for i in range(args.repeats):  # interleaved, alternating the order
            for name in names if i % 2 else names[::-1]:
                sync(args.device)
                start = time.perf_counter()
                step(name)
                sync(args.device)
                times[name].append(time.perf_counter() - start)
    finally:
        recompute_ops._RecordingCall = original
    for name in names[1:]:
        ratios = [a / b for a, b in zip(times[name], times["keeping"], strict=True)]
        print(
            f"  {name:20s} {statistics.median(ratios):.3f}x keeping "
            f"(median {statistics.median(times[name]) * 1e3:.1f} ms, {args.repeats} rounds)"
        )


if __name__ == "__main__":
    main()
