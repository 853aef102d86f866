"""Peak activation memory of a training step, with and without activation checkpointing:
torch.autocast against amp_graph.compile, side by side in one run.

HF GPT-2 (random weights, eager attention) in bf16, forward + backward of the summed
logits, on this CPU. Peak = the largest sum of bytes allocated minus freed during the step
(the profiler's allocation events, in time order; benchmarks/measure.py), i.e. the
activations and temporaries above the parameters that existed before the step. The
checkpointed variants call ``model.gradient_checkpointing_enable()`` (non-reentrant).

    python benchmarks/checkpoint_memory.py            # the run recorded in BENCHMARKS.md
    python benchmarks/checkpoint_memory.py --quick    # a smoke run (smaller model)
"""

from __future__ import annotations

import argparse
import platform
import statistics

import torch
import transformers
from measure import peak_cpu_step_mb

import amp_graph

DTYPE = torch.bfloat16


def _model(layers: int, width: int, checkpointing: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_positions=256, n_embd=width, n_layer=layers, n_head=4, vocab_size=512, use_cache=False
    )
    config._attn_implementation = "eager"
    model = transformers.GPT2LMHeadModel(config).train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    options = parser.parse_args()
    layers, width, batch, length = (2, 64, 2, 64) if options.quick else (6, 256, 8, 256)
    repeats = 1 if options.quick else 3
    ids = torch.randint(0, 512, (batch, length))
    print(
        f"HF GPT-2: {layers} layers, width {width}, batch {batch}x{length}, bf16; "
        f"CPU {platform.processor() or platform.machine()}, torch {torch.__version__}"
    )
    peaks: dict[str, float] = {}
    for checkpointing in (False, True):
        model = _model(layers, width, checkpointing)
        compiled = amp_graph.compile(model, "autocast", DTYPE, example_inputs=(ids,))

        def autocast_step(model=model) -> None:
            with torch.autocast("cpu", DTYPE):
                loss = model(ids).logits.float().sum()
            loss.backward()
            model.zero_grad(set_to_none=True)

        def amp_graph_step(model=model, compiled=compiled) -> None:
            compiled(ids).logits.float().sum().backward()
            model.zero_grad(set_to_none=True)

        suffix = "checkpointed" if checkpointing else "plain"
        for name, step in (("torch.autocast", autocast_step), ("amp_graph", amp_graph_step)):
            step()  # warm up (first-call allocations)
            peaks[f"{name} {suffix}"] = statistics.median(
                peak_cpu_step_mb(step) for _ in range(repeats)
            )
    reference = peaks["torch.autocast plain"]
    print(f"{'variant':32} {'peak MB':>9} {'vs autocast plain':>18}")
    for name, peak in peaks.items():
        print(f"{name:32} {peak:9.1f} {peak / reference:18.2f}")
    for name in ("torch.autocast", "amp_graph"):
        saved = peaks[f"{name} checkpointed"] / peaks[f"{name} plain"]
        print(f"{name}: checkpointed / plain = {saved:.2f}")


if __name__ == "__main__":
    main()
