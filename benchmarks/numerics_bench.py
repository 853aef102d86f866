"""What amp_graph.numerics costs, against the forward pass it diagnoses, side by side.

For the GPT-style decoder (amp_graph.demo.models.GPT) under each policy/dtype given, median of
``--repeats`` runs, interleaved:

  * the compiled forward (the denominator of the issue's "< 3x one forward pass");
  * ``amp_graph.numerics(compiled, x)``: the same graph node by node plus the float32
    shadow and a few reductions per node;
  * forward + backward of the compiled model, and ``numerics(..., backward=True)``;
  * the eager float32 forward, to show what the shadow itself costs on this machine
    (on CPUs without bf16/fp16 arithmetic the low-precision forward is the slow part).

    python benchmarks/numerics_bench.py              # recorded in BENCHMARKS.md
    python benchmarks/numerics_bench.py --quick
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
from measure import interleaved_seconds

import amp_graph
from amp_graph.demo import models


def median_ms(functions: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    times = interleaved_seconds(functions, repeats, warmup=1)  # captures happen in warm-up
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    batch, seq, dim, layers = (4, 32, 64, 2) if args.quick else (8, 64, 128, 4)
    model = models.GPT(vocab=256, block=seq, dim=dim, heads=4, layers=layers)
    idx = torch.randint(0, 256, (batch, seq))

    def loss(out: object) -> torch.Tensor:
        logits = out[0] if isinstance(out, tuple) else out
        return logits.float().square().mean()

    print(f"GPT-style decoder: batch {batch}, seq {seq}, dim {dim}, {layers} layers; CPU")
    print(
        f"{'policy':>8} {'dtype':>9} {'forward':>9} {'numerics':>9} {'ratio':>6} "
        f"{'fwd+bwd':>9} {'numerics bw':>11} {'ratio':>6} {'fp32 eager fwd':>14}"
    )
    for policy, dtype in (("O1", torch.bfloat16), ("O3", torch.float16)):
        compiled = amp_graph.compile(model, policy, dtype)

        def forward(c: torch.nn.Module = compiled) -> object:
            with torch.no_grad():
                return c(idx)

        def forward_backward(c: torch.nn.Module = compiled) -> object:
            out = c(idx)
            return torch.autograd.grad(loss(out), list(model.parameters()), allow_unused=True)

        def eager32() -> object:
            with torch.no_grad():
                return model(idx)

        t = median_ms(
            {
                "forward": forward,
                "numerics": lambda c=compiled: amp_graph.numerics(c, idx),
                "fwd+bwd": forward_backward,
                "numerics bw": lambda c=compiled: amp_graph.numerics(
                    c, idx, backward=True, loss_fn=loss
                ),
                "eager fp32": eager32,
            },
            args.repeats,
        )
        print(
            f"{policy:>8} {str(dtype).removeprefix('torch.'):>9} {t['forward']:9.1f} "
            f"{t['numerics']:9.1f} {t['numerics'] / t['forward']:6.2f} {t['fwd+bwd']:9.1f} "
            f"{t['numerics bw']:11.1f} {t['numerics bw'] / t['fwd+bwd']:6.2f} "
            f"{t['eager fp32']:14.1f}"
        )
    print("(ms, medians; ratio = numerics / the compiled pass it measures)")


if __name__ == "__main__":
    main()
