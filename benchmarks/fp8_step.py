"""fp8 that pays: a Llama-style stack's training step in fp8 against the same step in bf16 and
against torchao's float8 training, and the loss after 200 steps against bf16's own noise.

Issue 58: on a Llama-style stack (width 4096, 4 layers, 8x2048 tokens) on an H100/H200, fp8
>= 1.2x the bf16 step and >= torchao float8's step in the same run; loss within bf16's noise
after 200 steps.

**The step** (``--device cuda``): :class:`amp_graph.demo.models.LlamaWithLoss` at Llama-3-8B's
layer shapes (width 4096, SwiGLU 14336, 32 heads; vocabulary 32000, 4 layers), 8x2048 tokens,
fused AdamW. Variants, all through inductor (``--eager``: none is compiled):

* ``bf16 torch.compile``: ``torch.compile(model)`` under ``torch.autocast(bfloat16)``, the bf16
  step people run; the ratios are over it;
* ``bf16 amp_graph``: ``amp_graph.compile(model, "O1", bfloat16, mode="default")``;
* ``fp8 amp_graph tensorwise`` and ``fp8 amp_graph rowwise``: the ``"fp8"`` policy with that
  recipe, ``mode="default"`` (inductor fuses amax, scale and cast into their producers);
* ``fp8 torchao tensorwise``: ``torchao.float8.convert_to_float8_training`` then
  ``torch.compile`` under the same autocast, torchao's own recipe (absent torchao, the row
  says so and the others are measured).

Every fp8 variant keeps the output head in bf16 (torchtitan's filter: ``path != "head"``).
All variants share one model's parameters and one optimizer (an fp8 or a compiled module holds
the same ``nn.Parameter``), so that their steps can be interleaved without five copies of the
weights; the weights move a little each step, the same for every variant.

**The loss** (``--loss-steps``, 200): a smaller stack (``--loss-width``; 1024 on CUDA) learns a
fixed random bigram language (each token has four likely successors: the loss falls from
log(vocab) towards log 4), eagerly, from one initialization. bf16 runs three times, on three
orders of the data; its noise is the spread of their final losses (each the mean of the last
20 steps), or that mean's standard error over those steps if larger (three runs can agree by
chance). An fp8 variant, on the first order, is within bf16's noise when its final loss is
within that noise of the first bf16 run's.

    python benchmarks/fp8_step.py --device cuda            # the figures issue 58 asks for
    python benchmarks/fp8_step.py --device cuda --variants "fp8 amp_graph tensorwise"
    python benchmarks/fp8_step.py --device cpu --tiny --eager   # a check of the script
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from measure import cpu_name, interleaved_seconds, sync

import amp_graph
from amp_graph.demo import models

BF16 = torch.bfloat16
LLAMA_STACK = {"vocab": 32000, "dim": 4096, "blocks": 4, "heads": 32, "hidden": 14336}
LLAMA_TOKENS = (8, 2048)
TINY = {"vocab": 256, "dim": 64, "blocks": 2, "heads": 4, "hidden": 128}
TINY_TOKENS = (4, 64)
BASELINE = "bf16 torch.compile"
VARIANTS = (
    BASELINE,
    "bf16 amp_graph",
    "fp8 amp_graph tensorwise",
    "fp8 amp_graph rowwise",
    "fp8 torchao tensorwise",
)
SUCCESSORS = 4  # the bigram language's likely next tokens per token
LAST = 20  # the final loss: the mean of the last this many steps

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def not_the_head(module: nn.Module, path: str) -> bool:
    """The fp8 layer filter, amp_graph's and torchao's: the output head stays bf16."""
    return path != "head"


def shared_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s modules that holds the same parameters (deepcopy's memo)."""
    return copy.deepcopy(model, memo={id(p): p for p in model.parameters()})


def forward_of(model: nn.Module, variant: str, device: str, eager: bool) -> Callable:
    """What computes one variant's loss, and whether it needs torch.autocast around it."""
    mode = "eager" if eager else "default"
    if variant == BASELINE:
        return model if eager else torch.compile(model)
    if variant == "bf16 amp_graph":
        return amp_graph.compile(model, "O1", BF16, mode=mode)
    if variant.startswith("fp8 amp_graph"):
        recipe = variant.rsplit(" ", 1)[1]
        policy = amp_graph.Policy.preset("fp8").with_fp8(recipe=recipe, module_filter=not_the_head)
        return amp_graph.compile(model, policy, mode=mode)
    if variant == "fp8 torchao tensorwise":
        try:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        except ImportError as error:
            raise RuntimeError(f"torchao is not installed here ({error})") from error
        converted = convert_to_float8_training(
            shared_copy(model),
            config=Float8LinearConfig.from_recipe_name("tensorwise"),
            module_filter_fn=not_the_head,
        )
        return converted if eager else torch.compile(converted)
    raise ValueError(f"unknown variant {variant!r}; variants are {list(VARIANTS)}")


def needs_autocast(variant: str) -> bool:
    """torch's variants run under torch.autocast; amp_graph's casts are in its graph."""
    return "amp_graph" not in variant


def train_step(forward: Callable, variant: str, opt: torch.optim.Optimizer, device: str) -> Step:
    def step(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, BF16, enabled=needs_autocast(variant)):
            loss = forward(idx, targets)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def step_flops(config: dict[str, int], batch: int, seq: int) -> int:
    """The step's matmul FLOPs: 6 per weight per token, and causal attention's full
    ``12 L d T`` per token (PaLM's count; the embedding lookup is free)."""
    d, hidden, layers = config["dim"], config["hidden"], config["blocks"]
    weights = layers * (4 * d * d + 3 * d * hidden) + config["vocab"] * d
    return (6 * weights + 12 * layers * d * seq) * batch * seq


def time_steps(
    config: dict[str, int],
    tokens: tuple[int, int],
    variants: list[str],
    device: str,
    eager: bool,
    repeats: int,
    on_row: Callable[[dict[str, dict[str, Any]]], None] = lambda rows: None,
) -> dict[str, dict[str, Any]]:
    """Each variant's median step ms, interleaved, on one model's shared parameters.

    Before the interleaved rounds, each variant is timed alone right after its compile
    (``solo_ms``) and ``on_row`` is handed the rows so far: a run killed during a later
    variant's compile keeps the figures of the earlier ones. A failure in the interleaved
    rounds is reported in every row, which then keep their solo figures."""
    torch.manual_seed(0)
    with torch.device(device):  # initialized where it runs: 1.2B parameters on one CPU core
        model = models.LlamaWithLoss(**config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    idx = torch.randint(0, config["vocab"], tokens, device=device)
    targets = torch.randint(0, config["vocab"], tokens, device=device)
    flops = step_flops(config, *tokens)
    rows: dict[str, dict[str, Any]] = {}
    steps: dict[str, Callable[[], object]] = {}
    for variant in variants:
        try:
            step = train_step(forward_of(model, variant, device, eager), variant, opt, device)
            start = time.perf_counter()
            for _ in range(3):  # compilation, the optimizer's state
                step(idx, targets)
            sync(device)
            rows[variant] = {"first_calls_s": time.perf_counter() - start}
            steps[variant] = lambda s=step: s(idx, targets)
            solo = interleaved_seconds({variant: steps[variant]}, repeats, device=device)
            rows[variant]["solo_ms"] = statistics.median(solo[variant]) * 1e3
        except Exception as error:  # reported in its row; the others are measured
            rows[variant] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            steps.pop(variant, None)
        on_row(rows)
    try:
        times = interleaved_seconds(steps, repeats, device=device)
    except Exception as error:  # say so; the solo figures stand
        times = {}
        for variant in steps:
            rows[variant]["error"] = f"interleaved rounds: {type(error).__name__}: {error}"[:300]
    for variant, seconds in times.items():
        ms = statistics.median(seconds) * 1e3
        rows[variant] |= {"ms": ms, "tflops": flops / ms / 1e9}
    base = rows.get(BASELINE, {}).get("ms")
    for row in rows.values():
        if "ms" in row and base is not None:
            row["speedup_vs_bf16"] = base / row["ms"]
    return rows


def bigram_batches(
    vocab: int, tokens: tuple[int, int], steps: int, order: int, device: str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of one fixed bigram language (its table from seed 0), sampled in the
    order ``order`` seeds: inputs and next-token targets."""
    table = torch.randint(0, vocab, (vocab, SUCCESSORS), generator=torch.Generator().manual_seed(0))
    draw = torch.Generator().manual_seed(1000 + order)
    batch, seq = tokens
    out = []
    for _ in range(steps):
        seqs = torch.empty(batch, seq + 1, dtype=torch.long)
        seqs[:, 0] = torch.randint(0, vocab, (batch,), generator=draw)
        picks = torch.randint(0, SUCCESSORS, (batch, seq), generator=draw)
        for t in range(seq):
            seqs[:, t + 1] = table[seqs[:, t], picks[:, t]]
        seqs = seqs.to(device)
        out.append((seqs[:, :-1], seqs[:, 1:]))
    return out


def loss_curve(
    config: dict[str, int],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    variant: str,
    device: str,
) -> list[float]:
    """The losses of ``len(batches)`` eager steps of one variant from seed 0's weights."""
    torch.manual_seed(0)
    with torch.device(device):  # initialized where it trains, not on one CPU core
        model = models.LlamaWithLoss(**config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    step = train_step(forward_of(model, variant, device, eager=True), variant, opt, device)
    losses = [step(idx, targets) for idx, targets in batches]  # no host read per step
    return torch.stack(losses).float().tolist()


def loss_check(
    config: dict[str, int], tokens: tuple[int, int], steps: int, variants: list[str], device: str
) -> dict[str, Any]:
    """bf16's noise over three data orders, and whether each fp8 variant's final loss is in it."""
    orders = [bigram_batches(config["vocab"], tokens, steps, order, device) for order in range(3)]
    final: dict[str, float] = {}
    first: dict[str, float] = {}
    errors: dict[str, str] = {}
    runs = [
        ("bf16" if order == 0 else f"bf16, order {order}", BASELINE, order) for order in range(3)
    ]
    runs += [(v, v, 0) for v in variants if v.startswith("fp8")]
    standard_error = None
    for name, variant, order in runs:
        try:
            losses = loss_curve(config, orders[order], variant, device)
        except Exception as error:
            errors[name] = f"{type(error).__name__}: {str(error)[:300]}"
            continue
        first[name] = losses[0]
        final[name] = statistics.fmean(losses[-LAST:])
        if name == "bf16":
            standard_error = statistics.stdev(losses[-LAST:]) / LAST**0.5
    bf16 = [value for name, value in final.items() if name.startswith("bf16")]
    if len(bf16) < 3 or standard_error is None:
        return {"steps": steps, "errors": errors, "final": final, "first": first}
    spread = max(bf16) - min(bf16)
    allowed = max(spread, standard_error)
    within = {n: abs(v - final["bf16"]) <= allowed for n, v in final.items() if n.startswith("fp8")}
    return {
        "steps": steps,
        "tokens": list(tokens),
        "first": first,
        "final": final,
        "spread": spread,
        "standard_error": standard_error,
        "allowed": allowed,
        "within": within,
        "errors": errors,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a small stack (checks the script)")
    parser.add_argument("--eager", action="store_true", help="compile no variant")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--loss-steps", type=int, default=200, help="0: no loss check")
    parser.add_argument("--loss-width", type=int, default=None, help="the loss stack's width")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("fp8_step.py --device cuda needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 2
    variants = [BASELINE] + [v for v in args.variants if v != BASELINE]
    config, tokens = (TINY, TINY_TOKENS) if args.tiny else (LLAMA_STACK, LLAMA_TOKENS)
    name = torch.cuda.get_device_name() if device == "cuda" else cpu_name()
    report: dict[str, Any] = {"device": name, "torch": torch.__version__, "config": config}
    report["tokens"] = list(tokens)
    print(f"torch {torch.__version__} on {name}; Llama stack {config}, {tokens} tokens, AdamW")

    def save(rows: dict[str, dict[str, Any]]) -> None:
        if args.json:  # each variant as it is measured: a run cut short keeps them
            args.json.write_text(json.dumps(report | {"steps": rows}, indent=1))

    report["steps"] = time_steps(
        config, tokens, variants, device, args.eager, args.repeats, on_row=save
    )
    for variant, row in report["steps"].items():
        if "error" in row:
            print(f"{variant:<26} FAILED: {row['error']}")
            continue
        print(
            f"{variant:<26} {row['ms']:>9.2f} ms {row.get('speedup_vs_bf16', float('nan')):>6.3f}x "
            f"bf16  {row['tflops']:>8.4g} TFLOP/s  (first 3 calls {row['first_calls_s']:.1f} s)"
        )
    if args.json:  # the step's figures before the loss check: a run cut short keeps them
        args.json.write_text(json.dumps(report, indent=1))
    if args.loss_steps:
        width = args.loss_width or (1024 if device == "cuda" and not args.tiny else config["dim"])
        small = dict(config, dim=width, heads=max(1, width // 128) if width >= 128 else 4)
        small["hidden"] = config["hidden"] * width // config["dim"] // 16 * 16
        loss_tokens = (8, 512) if device == "cuda" and not args.tiny else tokens
        report["loss"] = loss_check(small, loss_tokens, args.loss_steps, variants, device)
        loss = report["loss"]
        report["loss"]["config"] = small
        print(f"== loss after {args.loss_steps} steps ({small}, {loss_tokens} tokens, eager)")
        for run, value in loss["final"].items():
            within = loss.get("within", {}).get(run)
            verdict = {None: "", True: "  within bf16's noise", False: "  OUTSIDE bf16's noise"}
            verdict = verdict[within]
            print(f"{run:<26} {loss['first'][run]:.3f} -> {value:.4f}{verdict}")
        for run, error in loss["errors"].items():
            print(f"{run:<26} FAILED: {error}")
        if "allowed" in loss:
            print(
                f"bf16's noise {loss['allowed']:.4f} (the larger of its spread over three data "
                f"orders, {loss['spread']:.4f}, and its final loss's standard error, "
                f"{loss['standard_error']:.4f})"
            )
        if args.json:
            args.json.write_text(json.dumps(report, indent=1))
    failed = any("error" in row for row in report["steps"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
