"""The loss computed outside the compiled model: what ``output_dtype=torch.float32`` costs
and buys.

torch.amp writes the loss inside the autocast region, and autocast computes
``cross_entropy`` in float32 from the bf16 logits. ``loss_fn(fast(x), y)`` computes it
outside the graph, in the dtype the logits come in: bf16 by default, float32 with
``output_dtype=torch.float32`` (the README's quickstart). This script measures, in one
run, on an HF Llama (random config, eager attention, a vocabulary large enough that the
logits are the step's largest tensor), a training step (forward, cross-entropy, backward)
in bf16:

1. **The loss**: its dtype, and its difference from the torch.autocast step's (the loss
   inside the region); each parameter's gradient against the float32 model's,
   ``|g - g32| / |g32|``, the median and the worst.
2. **Step time**: medians of per-round ratios against the torch.autocast step of the same
   round (rounds interleaved, order shuffled per round; torch.autocast measured twice, the
   second's ratio the noise floor), and the minor page faults per step: glibc's allocator
   returns large freed blocks to the system and faults them in again, by a pattern that
   moves with the order of frees (run it with ``MALLOC_MMAP_THRESHOLD_`` and
   ``MALLOC_TRIM_THRESHOLD_`` set high, as in BENCHMARKS.md, for a heap that stays).

    python benchmarks/loss_outside.py --repeats 31      # the run in BENCHMARKS.md
    python benchmarks/loss_outside.py --repeats 31 --recompute-casts false
    python benchmarks/loss_outside.py --quick
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import resource
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from measure import cpu_name, interleaved_seconds, peak_cpu_next_step_mb
from shared_cast_reads import llama

import amp_graph

BF16 = torch.bfloat16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--tokens", type=int, nargs=2, default=(4, 128), metavar=("B", "T"))
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--recompute-casts",
        choices=("auto", "false"),
        default="auto",
        help="the compiled variants' Policy.recompute_casts (default: the presets' 'auto')",
    )
    parser.add_argument("--quick", action="store_true", help="width 64, vocab 1024, 5 rounds")
    args = parser.parse_args()
    if args.quick:
        args.width, args.vocab, args.repeats = 64, 1024, 5
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {cpu_name()}, {args.threads} threads, bf16")
    base = llama(args.width, args.layers, args.vocab)
    batch, seq = args.tokens
    ids = torch.randint(0, args.vocab, (batch, seq))
    targets = torch.randint(0, args.vocab, (batch * seq,))
    print(
        f"HF Llama (eager attention), {args.layers} layers, width {args.width}, vocabulary "
        f"{args.vocab}, {batch}x{seq} tokens; loss: cross_entropy of the logits"
    )

    def loss_of(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets)

    reference = copy.deepcopy(base)
    loss_of(reference(ids).logits).backward()
    exact = {n: p.grad for n, p in reference.named_parameters()}

    variants: dict[str, tuple[nn.Module, Callable[[], torch.Tensor]]] = {}

    def autocast_step(model: nn.Module, loss_inside: bool) -> Callable[[], torch.Tensor]:
        def step() -> torch.Tensor:
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", BF16):
                logits = model(ids).logits
                loss = loss_of(logits) if loss_inside else None
            loss = loss if loss is not None else loss_of(logits)
            loss.backward()
            return loss.detach()

        return step

    def graph_step(model: nn.Module, compiled: Any, upcast: bool) -> Callable[[], torch.Tensor]:
        def step() -> torch.Tensor:
            model.zero_grad(set_to_none=True)
            logits = compiled(ids).logits
            loss = loss_of(logits.float() if upcast else logits)
            loss.backward()
            return loss.detach()

        return step

    for name, inside in (
        ("torch.autocast, loss inside", True),
        ("torch.autocast, loss inside [again]", True),  # its ratio is the noise floor
        ("torch.autocast, loss outside", False),
    ):
        model = copy.deepcopy(base)
        variants[name] = (model, autocast_step(model, inside))
    for policy in ("O1", "autocast"):
        for output_dtype, upcast, how in (
            (torch.float32, False, "output_dtype=fp32"),
            (None, True, ".float() in the loop"),
            (None, False, "as computed"),
        ):
            model = copy.deepcopy(base)
            preset = amp_graph.Policy.preset(policy)
            if args.recompute_casts == "false":
                preset = dataclasses.replace(preset, recompute_casts=False)
            compiled = amp_graph.compile(model, preset, BF16, output_dtype=output_dtype)
            step = graph_step(model, compiled, upcast)
            step()  # captured and rewritten at the first call
            variants[f"{policy}, {how}"] = (model, step)

    expected = variants["torch.autocast, loss inside"][1]()
    print("== the loss, and the gradients against float32 (|g - g32| / |g32| per parameter)")
    print(f"  {'variant':36s} {'loss':>5s} {'|loss - autocast|':>18s} {'median':>9s} {'worst':>9s}")
    peaks = {name: peak_cpu_next_step_mb(step) for name, (_, step) in variants.items()}
    for name, (model, step) in variants.items():
        loss = step()
        errors = [
            ((p.grad - exact[n]).norm() / exact[n].norm()).item()
            for n, p in model.named_parameters()
            if p.grad is not None and exact[n].norm() > 0
        ]
        gap = (loss.float() - expected).abs().item()
        print(
            f"  {name:36s} {amp_graph.passes.meta.short(loss.dtype):>5s} {gap:18.2e} "
            f"{statistics.median(errors):9.5f} {max(errors):9.5f}"
        )

    faults = dict.fromkeys(variants, 0)

    def counted(name: str, step: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            step()
            faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

        return run

    steps = {name: counted(name, step) for name, (_, step) in variants.items()}
    times = interleaved_seconds(steps, args.repeats, warmup=2)
    calls = args.repeats + 2
    print(f"== step time, {args.repeats} interleaved rounds")
    print(
        f"  {'variant':36s} {'median ms':>10s} {'/ torch.autocast':>17s} {'faults/step':>12s} "
        f"{'peak MiB':>9s}"
    )
    ref = times["torch.autocast, loss inside"]
    for name, seconds in times.items():
        ratio = statistics.median(t / r for t, r in zip(seconds, ref, strict=True))
        print(
            f"  {name:36s} {statistics.median(seconds) * 1e3:10.2f} {ratio:17.3f} "
            f"{faults[name] / calls:12.0f} {peaks[name]:9.1f}"
        )


if __name__ == "__main__":
    main()
