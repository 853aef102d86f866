"""The eager step with the recompute of casts decided by its cost (issue 41, part 3), in one run.

``Policy(recompute_casts="auto")`` (the default) recomputes in backward only the casts
whose copies are large enough, on this device, for the recompute's host time to be paid
by its bytes (:mod:`amp_graph.ops.recompute_cost`). This script shows what that decides
and what it costs, against the two fixed choices (``True``: every cast, the default before;
``False``: none, as torch.autocast):

1. **Step time**: forward, backward and a fused SGD step (momentum 0.9) of
   ``amp_graph.demo.models.GPTWithLoss`` (4 layers, vocabulary 256), bf16, under
   ``amp_graph.compile`` with ``policy="autocast"`` and ``"O1"``, each with the three
   settings, against a hand-written ``torch.autocast`` loop over the same model. Rounds
   interleaved (order reversed every other round); each figure is the median over rounds
   of (variant / hand-written) within the round. Width 128 at 4x64 tokens and width 384 at
   8x128 (``--widths``). With ``--llama``, an HF Llama (eager attention, width 512, 4
   layers, 4x128 tokens, no optimizer) under O1 too: few tokens against large weights,
   where a recast's bytes show in the step and ``"auto"`` keeps the copies (the recomputes
   may take at most 1% of a step estimated from its matmul FLOPs).
2. **Held for backward**: the bytes the forward leaves alive for backward
   (:mod:`amp_graph.inspect.held`), parameters left out, under O1 against torch.autocast,
   for the GPT and an HF Llama (eager attention, 2 layers) of width 512 at 4x64 tokens:
   where the weight copies are a large part of what is held.

It prints the device's measured cost first, and what ``"auto"`` decided on each model.
``--device cuda --gpt2`` times the step of GPT-2 small's shape instead (12 layers, width
768, 12 heads, vocabulary 8192, 8x512 tokens; no held section): ``make gpu-check`` runs it,
with ``--json`` for its report.

    python benchmarks/eager_step.py --threads 1 --llama   # the run in BENCHMARKS.md
    python benchmarks/eager_step.py --quick
    python benchmarks/eager_step.py --device cuda --gpt2 --repeats 9 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from measure import cpu_name, sync

import amp_graph
from amp_graph.demo import models
from amp_graph.inspect.held import held_for_backward
from amp_graph.ops.recompute_cost import measured_cost

BF16 = torch.bfloat16
VOCAB = 256
SETTINGS = {"auto": "auto", "every cast": True, "none": False}


def _policy(name: str, recompute: Any) -> amp_graph.Policy:
    return dataclasses.replace(amp_graph.Policy.preset(name), recompute_casts=recompute)


def _decided(compiled: Any) -> str:
    report = amp_graph.report(compiled)
    return (
        f"{report.casts_recomputed} recomputed ({report.recomputed_cast_bytes / 2**20:.2f} MiB), "
        f"{report.casts_recompute_declined} kept"
    )


def step_times(
    device: str, dim: int, layers: int, heads: int, vocab: int, batch: int, seq: int, repeats: int
) -> dict[str, Any]:
    """Step / torch.autocast per (policy, setting), with what "auto" decided; printed too."""
    torch.manual_seed(0)
    model = models.GPTWithLoss(vocab=vocab, block=seq, dim=dim, heads=heads, layers=layers)
    model = model.to(device)
    idx = torch.randint(0, vocab, (batch, seq), device=device)
    targets = torch.randint(0, vocab, (batch, seq), device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9, fused=True)

    def step_of(forward: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def step() -> None:
            forward().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    def hand() -> torch.Tensor:
        with torch.autocast(device, BF16):
            return model(idx, targets)

    steps = {"torch.autocast": step_of(hand)}
    decided = {}
    for policy in ("autocast", "O1"):
        for setting, value in SETTINGS.items():
            compiled = amp_graph.compile(model, _policy(policy, value), BF16, mode="eager")
            compiled(idx, targets)  # capture
            decided[f"{policy}, {setting}"] = _decided(compiled)
            steps[f"{policy}, {setting}"] = step_of(lambda c=compiled: c(idx, targets))
    shape = f"GPT width {dim}, {layers} layers, {batch}x{seq} tokens"
    return _timed(steps, decided, shape, device, repeats)


def llama_step_times(
    device: str, dim: int, layers: int, batch: int, seq: int, repeats: int
) -> dict[str, Any]:
    """The same table for an HF Llama (eager attention, random config) under O1: few tokens
    against large weights, where the recasts' bytes show in the step (the loss, the logits'
    mean logsumexp, computed outside the model; no optimizer)."""
    made = _llama(dim, layers=layers, tokens=(batch, seq))
    if made is None:
        print("\nHF Llama: transformers is not installed")
        return {}
    model, call = made
    model = model.to(device)

    def step_of(forward: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def step() -> None:
            model.zero_grad(set_to_none=True)
            forward().float().logsumexp(-1).mean().backward()

        return step

    def hand() -> torch.Tensor:
        with torch.autocast(device, BF16):
            return call(model)

    steps = {"torch.autocast": step_of(hand)}
    decided = {}
    for setting, value in SETTINGS.items():
        compiled = amp_graph.compile(model, _policy("O1", value), BF16, mode="eager")
        call(compiled)  # capture
        decided[f"O1, {setting}"] = _decided(compiled)
        steps[f"O1, {setting}"] = step_of(lambda c=compiled: call(c))
    shape = f"HF Llama width {dim}, {layers} layers, {batch}x{seq} tokens"
    return _timed(steps, decided, shape, device, repeats)


def _timed(
    steps: dict[str, Callable[[], None]],
    decided: dict[str, str],
    shape: str,
    device: str,
    repeats: int,
) -> dict[str, Any]:
    for step in steps.values():
        for _ in range(3):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in range(repeats):
        order = list(steps) if round_ % 2 == 0 else list(reversed(steps))
        for name in order:
            sync(device)
            start = time.perf_counter()
            steps[name]()
            sync(device)
            times[name].append(time.perf_counter() - start)
    hand_ms = statistics.median(times["torch.autocast"]) * 1e3
    print(f"\n{shape} on {device}: torch.autocast {hand_ms:.2f} ms")
    print("| compile policy, recompute_casts | step / torch.autocast | decided |")
    print("|---|---|---|")
    ratios = {}
    for name in steps:
        if name == "torch.autocast":
            continue
        per_round = [v / h for v, h in zip(times[name], times["torch.autocast"], strict=True)]
        ratios[name] = statistics.median(per_round)
        print(f"| {name} | {ratios[name]:.3f} | {decided[name]} |")
    return {"shape": shape, "hand_ms": hand_ms, "ratios": ratios, "decided": decided}


def _gpt(dim: int) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    model = models.GPT(vocab=VOCAB, block=64, dim=dim, heads=8, layers=4)
    idx = torch.randint(0, VOCAB, (4, 64))
    return model, lambda m: m(idx)


def _llama(
    dim: int, layers: int = 2, tokens: tuple[int, int] = (4, 64)
) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]] | None:
    try:
        import transformers
    except ImportError:
        return None
    config = transformers.LlamaConfig(
        hidden_size=dim,
        intermediate_size=dim * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=VOCAB,
        max_position_embeddings=max(64, tokens[1]),
        use_cache=False,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, tokens)
    return transformers.LlamaForCausalLM(config).train(), lambda m: m(ids).logits


def _held_row(model: nn.Module, call: Callable[[nn.Module], torch.Tensor]) -> str:
    exclude = [*model.parameters(), *model.buffers()]

    def forward_held(forward: Callable[[], torch.Tensor]) -> int:
        nbytes, out = held_for_backward(forward, exclude)
        out.float().square().mean().backward()
        model.zero_grad(set_to_none=True)
        return nbytes

    def autocast() -> torch.Tensor:
        with torch.autocast("cpu", BF16):
            return call(model)

    base = forward_held(autocast)
    cells, decided = [], ""
    for setting, value in SETTINGS.items():
        compiled = amp_graph.compile(model, _policy("O1", value), BF16, mode="eager")
        forward_held(lambda c=compiled: call(c))  # capture
        nbytes = forward_held(lambda c=compiled: call(c))
        cells.append(f"{nbytes / 2**20:.2f} ({nbytes / base:.2f}x)")
        if setting == "auto":
            decided = _decided(compiled)
    return f"{base / 2**20:.2f} | {' | '.join(cells)} | {decided}"


def held(dim: int) -> None:
    print(f"\nHeld for backward, width {dim}, 4x64 tokens, O1 bf16 (MiB; / torch.autocast):")
    print("| model | torch.autocast | auto | every cast | none | auto decided |")
    print("|---|---|---|---|---|---|")
    for name, made in (("GPT, 4 layers", _gpt(dim)), ("HF Llama, 2 layers", _llama(dim))):
        row = "transformers is not installed | | | | |" if made is None else _held_row(*made)
        print(f"| {name} | {row} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads")
    parser.add_argument("--widths", default="128,384", help="GPT widths for the step times")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--gpt2", action="store_true", help="GPT-2 small's shape, 8x512 tokens")
    parser.add_argument("--no-held", action="store_true", help="skip the held-bytes section")
    parser.add_argument(
        "--llama", action="store_true", help="also an HF Llama's step (width 512, 4x128 tokens)"
    )
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    where = torch.cuda.get_device_name() if args.device == "cuda" else cpu_name()
    print(f"{where}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    cost = measured_cost(args.device)
    print(f"measured: {cost.describe()}")
    report: dict[str, Any] = {"device": where, "cost": dataclasses.asdict(cost), "steps": []}
    report["cost"]["min_copy_bytes"] = cost.min_copy_bytes
    if args.gpt2:
        shapes = [(768, 12, 12, 8192, 8, 512, args.repeats or 9)]
    else:
        shapes = []
        for dim in (int(w) for w in args.widths.split(",")):
            batch, seq = {128: (4, 64), 384: (8, 128)}.get(dim, (4, 64))
            repeats = args.repeats or (5 if args.quick else (101 if dim <= 128 else 21))
            shapes.append((dim, 4, 4, VOCAB, batch, seq, repeats))
    for dim, layers, heads, vocab, batch, seq, repeats in shapes:
        report["steps"].append(
            step_times(args.device, dim, layers, heads, vocab, batch, seq, repeats)
        )
    if args.llama:
        repeats = args.repeats or (5 if args.quick else 41)
        width, layers = (128, 2) if args.quick else (512, 4)
        report["steps"].append(llama_step_times(args.device, width, layers, 4, 128, repeats))
    if not (args.no_held or args.gpt2 or args.device != "cpu"):
        held(512)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)


if __name__ == "__main__":
    main()
