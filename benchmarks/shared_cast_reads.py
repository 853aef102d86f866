"""What a shared cast's gradients per consumer cost and buy (``cast_gradients_per_consumer``).

One cast of an activation serves every op that reads it (Llama's q, k and v projections of
one RMSNorm output; its gate and up projections of another). With
``Policy(cast_gradients_per_consumer=True)`` (the ``"autocast"`` preset's) each consumer
casts its own (a copy small enough for its bytes to cost less than a read's Python, as
measured on the device) or reads it through a ``cast_read``, so that the consumers'
gradients sum in float32 at the source, as under torch.autocast; with False (the other
presets') they sum in bf16 at the copy. This script measures, in one run, on an HF Llama
(random config, eager attention), a training step (forward with the loss, backward) in
bf16, under O1 and ``"autocast"`` each way:

1. **Gradient error**: each parameter's gradient against the float32 model's,
   ``|g - g32| / |g32|`` by parameter, the median and the worst, and torch.autocast's.
2. **Step time**: medians of per-round ratios against the torch.autocast step of the same
   round (rounds interleaved, order shuffled per round; torch.autocast measured twice, the
   second's ratio the noise floor). Per consumer adds a Python ``autograd.Function`` call
   per reading consumer on the eager path (a cast per casting one), and backward converts
   each consumer's gradient and sums in float32, as autocast does. The table says how
   many consumers read and how many cast their own.

    python benchmarks/shared_cast_reads.py --repeats 41         # the run in BENCHMARKS.md
    python benchmarks/shared_cast_reads.py --width 128 --layers 2 --repeats 41  # casts
    python benchmarks/shared_cast_reads.py --quick
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import transformers
from measure import cpu_name, interleaved_seconds

import amp_graph
from amp_graph.frontends.compiler import compile_record

BF16 = torch.bfloat16


def llama(width: int, layers: int, vocab: int = 512) -> nn.Module:
    """A random HF Llama (eager attention) of this width, depth and vocabulary, in train
    mode (also ``loss_outside.py``'s)."""
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=width * 8 // 3 // 8 * 8,
        num_hidden_layers=layers,
        num_attention_heads=max(width // 64, 2),
        num_key_value_heads=max(width // 128, 1),
        max_position_embeddings=1024,
        use_cache=False,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()


def _policy(name: str, per_consumer: bool) -> amp_graph.Policy:
    preset = amp_graph.Policy.preset(name)
    return dataclasses.replace(preset, cast_gradients_per_consumer=per_consumer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, nargs=2, default=(4, 128), metavar=("B", "T"))
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="width 128, 2 layers, 5 rounds")
    args = parser.parse_args()
    if args.quick:
        args.width, args.layers, args.repeats = 128, 2, 5
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {cpu_name()}, {args.threads} threads, bf16")
    base = llama(args.width, args.layers)
    batch, seq = args.tokens
    ids = torch.randint(0, 512, (batch, seq))
    print(
        f"HF Llama (eager attention), {args.layers} layers, width {args.width}, "
        f"{batch}x{seq} tokens; loss: the logits' mean logsumexp"
    )

    def loss(out: Any) -> torch.Tensor:
        return out.logits.float().logsumexp(-1).mean()

    reference = copy.deepcopy(base)
    loss(reference(ids)).backward()
    exact = {n: p.grad for n, p in reference.named_parameters()}

    variants: dict[str, tuple[nn.Module, Callable[[], Any]]] = {}

    def autocast_step(model: nn.Module) -> Callable[[], Any]:
        def step() -> None:
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", BF16):
                out = model(ids)
            loss(out).backward()

        return step

    def graph_step(model: nn.Module, compiled: Any) -> Callable[[], Any]:
        def step() -> None:
            model.zero_grad(set_to_none=True)
            loss(compiled(ids)).backward()

        return step

    model = copy.deepcopy(base)
    variants["torch.autocast"] = (model, autocast_step(model))
    model = copy.deepcopy(base)  # the reference again: its ratio is the noise floor
    variants["torch.autocast [again]"] = (model, autocast_step(model))
    made = {}  # "reads / own casts" the pass made, per variant
    for policy in ("O1", "autocast"):
        for with_pass in (True, False):
            model = copy.deepcopy(base)
            compiled = amp_graph.compile(model, _policy(policy, with_pass), BF16)
            name = f"{policy} {'per consumer' if with_pass else 'shared'}"
            step = graph_step(model, compiled)
            step()  # captured and rewritten at the first call
            stats = compile_record(compiled).stats
            made[name] = (
                f"{stats.get('shared_cast_reads', 0)} / {stats.get('shared_cast_own_casts', 0)}"
            )
            variants[name] = (model, step)

    print("== gradients against float32 (|g - g32| / |g32| per parameter)")
    print(f"  {'variant':28s} {'median':>9s} {'worst':>9s}  reads / own casts")
    for name, (model, step) in variants.items():
        step()
        errors = [
            ((p.grad - exact[n]).norm() / exact[n].norm()).item()
            for n, p in model.named_parameters()
            if p.grad is not None and exact[n].norm() > 0
        ]
        print(
            f"  {name:28s} {statistics.median(errors):9.5f} {max(errors):9.5f}  "
            f"{made.get(name, '-')}"
        )

    times = interleaved_seconds(
        {name: step for name, (_, step) in variants.items()}, args.repeats, warmup=2
    )
    print(f"== step time, {args.repeats} interleaved rounds")
    print(f"  {'variant':28s} {'median ms':>10s} {'/ torch.autocast':>17s}")
    ref = times["torch.autocast"]
    for name, seconds in times.items():
        ratio = statistics.median(t / r for t, r in zip(seconds, ref, strict=True))
        print(f"  {name:28s} {statistics.median(seconds) * 1e3:10.2f} {ratio:17.3f}")


if __name__ == "__main__":
    main()
