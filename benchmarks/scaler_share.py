"""The check+unscale's share of a Graph training step on the GPT-2-small shape (GPU).

    python benchmarks/scaler_share.py                  # 8x512 tokens, float16
    python benchmarks/scaler_share.py --batch 64 --json share.json

The model is ``graph_bench.py --large``'s: ``models.GPTWithLoss`` with 12 layers, width 768,
12 heads, vocabulary 8192 (about 92M parameters, 148 gradients), fused AdamW, as an
``amp_graph.Graph`` under O1 float16 with ``amp_graph.GradScaler``. Printed: the step's median
time (CUDA events over whole steps), and, on the very gradients the step produced, the median
time of one check+unscale by amp_graph's op (the scaler's) and by torch's
``_amp_foreach_non_finite_check_and_unscale_`` (what ``torch.amp.GradScaler`` runs), each
with its share of the step. Device time and host time both count: the op is timed with CUDA
events around its call, so a call whose host work outlasts its kernels is charged the host's time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import kernel_bench
import torch
from graph_bench import StepGraph, setups

from amp_graph.ops import scaler_ops as ops


def event_ms(fn, reps: int) -> float:  # type: ignore[no-untyped-def]
    """Median ms of ``reps`` calls, each timed alone with CUDA events."""
    return statistics.median(kernel_bench._time_ms(fn, "cuda") for _ in range(reps))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8, help="sequences of 512 tokens per step")
    parser.add_argument("--steps", type=int, default=15, help="timed steps")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    (setup,) = [s for s in setups("cuda", True, False, args.batch) if "12 layers" in s.name]
    graph = StepGraph(setup, setup.model, "O1", torch.float16)
    x, y = setup.inputs
    for _ in range(5):
        graph(x, y)
    torch.cuda.synchronize()
    step_ms = event_ms(lambda: graph(x, y), args.steps)

    grads = [p.grad for p in setup.model.parameters() if p.grad is not None]
    found = torch.zeros((), device="cuda")
    one = torch.ones((), device="cuda")  # x * 1 == x: the gradients keep their values
    ours_ms = event_ms(lambda: ops.non_finite_check_and_unscale_(grads, found, one), 50)
    torch_ms = event_ms(
        lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one), 50
    )
    mbytes = sum(g.numel() * g.element_size() for g in grads) / 1e6
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "tokens": f"{args.batch}x512",
        "gradients": len(grads),
        "gradient_mbytes": mbytes,
        "grad_dtypes": sorted({str(g.dtype) for g in grads}),
        "step_ms": step_ms,
        "ours_ms": ours_ms,
        "torch_ms": torch_ms,
        "ours_share": ours_ms / step_ms,
        "torch_share": torch_ms / step_ms,
    }
    print(
        f"{result['device']}, torch {result['torch']}: Graph O1 fp16 step, GPT 12x768, "
        f"{result['tokens']} tokens, {len(grads)} gradients ({mbytes:.0f} MB): "
        f"{step_ms:.2f} ms; check+unscale: amp_graph {ours_ms:.3f} ms "
        f"({100 * result['ours_share']:.2f}% of the step), torch's op {torch_ms:.3f} ms "
        f"({100 * result['torch_share']:.2f}%)"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
