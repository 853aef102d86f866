"""The per-GEMM fp8 cost model on this device: its measured figures, and its predictions
against layer times measured at shapes the fit never saw.

``Fp8Config(cost_model="measured")`` decides each linear by the model
(:mod:`amp_graph.policy.fp8_cost`). This script measures the model as the first fp8 capture
would (:func:`amp_graph.ops.fp8_speed.measured_fp8_cost`), then times one layer's forward and
backward in bf16 and through the fp8 ops at held-out shapes, and prints per shape the
predicted and the measured fp8/bf16 ratio and whether the decision (fp8 at <= 0.9x) was
right. Shapes: between the fit's on the CPU; GPT-2 small's and a Llama-style stack's
(width 4096, 8x2048 tokens) on CUDA.

    python benchmarks/fp8_cost_model.py --device cpu          # about 20 s
    python benchmarks/fp8_cost_model.py --device cuda --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from measure import cpu_name

from amp_graph.ops.fp8_speed import fastest_ns, layer_step, measured_fp8_cost
from amp_graph.ops.recompute_cost import synchronizer

HELD_OUT = {
    "cpu": [(128, 128, 128), (384, 128, 256), (512, 256, 128), (128, 512, 512)],
    "cuda": [
        (4096, 768, 768),  # GPT-2 small, 8x512 tokens: attention projection
        (4096, 768, 3072),  # its MLP up
        (16384, 4096, 4096),  # Llama-style, 8x2048 tokens: attention projection
        (16384, 4096, 11008),  # its MLP up
        (16384, 4096, 64),  # a narrow head
    ],
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("fp8_cost_model.py --device cuda needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    where = torch.cuda.get_device_name() if device.type == "cuda" else cpu_name()
    start = time.perf_counter()
    model = measured_fp8_cost(device)
    took = time.perf_counter() - start
    print(f"{where}; torch {torch.__version__}; {torch.get_num_threads()} threads")
    print(f"measured in {took:.2f} s: {model.describe()}")
    sync = synchronizer(device)
    rows = []
    print(f"  {'M x K x N':>20s} {'predicted':>9s} {'measured':>9s} {'decision':>9s} {'right':>6s}")
    for m, k, n in HELD_OUT[device.type]:
        bf16 = fastest_ns(layer_step(m, k, n, False, device, "tensorwise"), sync)
        fp8 = fastest_ns(layer_step(m, k, n, True, device, "tensorwise"), sync)
        predicted, measured = model.ratio(m, k, n), fp8 / bf16
        right = model.pays(m, k, n) == (measured <= model.margin)
        decision = "fp8" if model.pays(m, k, n) else "bf16"
        print(f"  {f'{m} x {k} x {n}':>20s} {predicted:9.2f} {measured:9.2f} {decision:>9s} "
              f"{'yes' if right else 'NO':>6s}")  # fmt: skip
        rows.append({"shape": [m, k, n], "predicted": predicted, "measured": measured,
                     "fp8": model.pays(m, k, n), "right": right})  # fmt: skip
    if args.json:
        with open(args.json, "w") as out:
            report = {"device": where, "model": model.describe(), "seconds": took, "rows": rows}
            json.dump(report, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
