"""fp8 training step vs bf16 on the GPT-style decoder, side by side in one run.

Variants of one train step (forward, backward, fused AdamW) on the same weights and batch:

* ``bf16 autocast``: the model under ``torch.autocast(device, bfloat16)``;
* ``fp8 linears``: the model's ``torch.export`` graph rewritten by
  ``passes/fp8_linears.py`` (every linear a float8 scaled matmul, tensorwise recipe), run
  under the same autocast, which plays the O1-bf16 passes for the other ops;
* ``fp32`` (CPU only, for context: this CPU has no bf16 arithmetic);
* with ``--compile`` (the default on CUDA) both bf16 and fp8 again through
  ``torch.compile`` (inductor fuses the fp8 scale and quantize ops into few kernels, as
  torchao relies on).

Printed: median step time and ratio to bf16 autocast (interleaved repeats); the bytes autograd
saves for backward (eager variants: unique non-parameter storages seen by
``saved_tensors_hooks``; fp8 keeps its linears' operands in float8); the peak memory one step
allocates (CPU: profiler allocation events; CUDA: ``max_memory_allocated``). A microbenchmark
of one large linear layer (forward + backward) follows.

On a CPU fp8 is an emulation (``torch._scaled_mm`` dequantizes to float32): expect no speed.

    python benchmarks/fp8_bench.py                 # the CPU run recorded in BENCHMARKS.md
    python benchmarks/fp8_bench.py --quick
    python benchmarks/fp8_bench.py --device cuda   # GPU (sm_89+), under 10 minutes
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn as nn
from amp_graph.passes.fp8_linears import fp8_linears
from measure import interleaved_seconds, peak_cpu_step_mb, sync

from amp_graph.demo import models
from amp_graph.ops import fp8_ops

BF16 = torch.bfloat16
Step = Callable[[], None]


def train_step(net: nn.Module, params: nn.Module, inputs: tuple, device: str, dtype) -> Step:
    opt = torch.optim.AdamW(params.parameters(), lr=1e-4, fused=True)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        if dtype is None:
            loss = net(*inputs)
        else:
            with torch.autocast(device, dtype):
                loss = net(*inputs)
        loss.backward()
        opt.step()

    return step


def fp8_model(model: nn.Module, inputs: tuple) -> tuple[nn.Module, int]:
    gm = torch.export.export(model, inputs, strict=False).module()
    converted = fp8_linears(gm, root=model).stats["fp8_linears"]
    gm.recompile()  # a pass edits the graph only (passes/result.py): the code must follow it
    return gm, converted


def saved_mb(step: Step, model: nn.Module) -> dict[str, float]:
    """MB of the distinct non-parameter storages autograd saves for backward during one step,
    by dtype."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[str, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = (str(t.dtype).removeprefix("torch."), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    by_dtype: dict[str, float] = {}
    for dtype, nbytes in seen.values():
        by_dtype[dtype] = by_dtype.get(dtype, 0.0) + nbytes / 2**20
    return by_dtype


def peak_mb(step: Step, device: str) -> float:
    """The most memory allocated during one step above what existed before it."""
    if device == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        sync(device)
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    return peak_cpu_step_mb(step)


def _median_ms(steps: dict[str, Step], repeats: int, device: str) -> dict[str, float]:
    times = interleaved_seconds(steps, repeats, device=device)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def gpt_section(args: argparse.Namespace) -> None:
    device = args.device
    if device == "cuda":
        vocab, seq, dim, heads, layers, batch = 8192, 1024, 2048, 16, 4, 8
    elif args.quick:
        vocab, seq, dim, heads, layers, batch = 256, 64, 128, 4, 2, 4
    else:
        vocab, seq, dim, heads, layers, batch = 512, 128, 256, 8, 4, 16
    torch.manual_seed(0)
    base = models.GPTWithLoss(vocab=vocab, block=seq, dim=dim, heads=heads, layers=layers)
    base = base.to(device)
    inputs = (
        torch.randint(0, vocab, (batch, seq), device=device),
        torch.randint(0, vocab, (batch, seq), device=device),
    )
    variants: dict[str, tuple[Step, nn.Module, bool]] = {}  # step, its parameters, eager
    if device == "cpu":
        model = copy.deepcopy(base)
        variants["fp32"] = (train_step(model, model, inputs, device, None), model, True)
    model = copy.deepcopy(base)
    variants["bf16 autocast"] = (train_step(model, model, inputs, device, BF16), model, True)
    model = copy.deepcopy(base)
    gm, converted = fp8_model(model, inputs)
    variants["fp8 linears"] = (train_step(gm, model, inputs, device, BF16), model, True)
    if args.compile:
        model = copy.deepcopy(base)
        compiled = torch.compile(model)
        variants["bf16 compiled"] = (
            train_step(compiled, model, inputs, device, BF16),
            model,
            False,
        )
        model = copy.deepcopy(base)
        compiled = torch.compile(fp8_model(model, inputs)[0])
        variants["fp8 compiled"] = (train_step(compiled, model, inputs, device, BF16), model, False)

    print(
        f"== GPT train step: vocab {vocab}, {layers} layers, dim {dim}, {heads} heads, batch "
        f"{batch}x{seq}; fused AdamW; fp8: {converted} linears (tensorwise)"
    )
    saved, peak = {}, {}
    for name, (step, model, eager) in variants.items():
        start = time.perf_counter()
        step()  # warm up (and compile)
        step()
        sync(device)
        warm = time.perf_counter() - start
        saved[name] = saved_mb(step, model) if eager else {}
        if name == "fp8 linears" and not any("float8" in dtype for dtype in saved[name]):
            # the rewritten graph did not run (its code was not regenerated once): a bf16 step
            # timed under the fp8 name, as this script once did
            raise RuntimeError("the fp8 variant saved no float8 operand: its linears did not run")
        peak[name] = peak_mb(step, device)
        print(f"  warmed up {name} in {warm:.1f} s")
    med = _median_ms({k: v[0] for k, v in variants.items()}, args.repeats, device)
    ref = med["bf16 autocast"]
    print(
        f"{'variant':<16} {'median ms':>10} {'vs bf16':>8} {'saved for bwd MB':>17} "
        f"{'peak step MB':>13}"
    )
    for name in variants:
        total = f"{sum(saved[name].values()):.1f}" if saved[name] else "-"
        print(
            f"{name:<16} {med[name]:>10.2f} {med[name] / ref:>8.2f} {total:>17} {peak[name]:>13.1f}"
        )
    print("saved for backward, MB by dtype:")
    for name, by_dtype in saved.items():
        if by_dtype:
            parts = ", ".join(f"{d} {mb:.1f}" for d, mb in sorted(by_dtype.items()))
            print(f"  {name:<16} {parts}")
    print()


def linear_section(args: argparse.Namespace) -> None:
    """One linear layer, forward + backward, bf16 (autocast) vs fp8."""
    device = args.device
    sizes = [(8192, 4096, 4096), (8192, 8192, 8192)] if device == "cuda" else [(2048, 1024, 1024)]
    if args.quick and device == "cpu":
        sizes = [(512, 256, 256)]
    print("== one linear layer, forward + backward (x requires grad)")
    print(f"{'M x K x N':<20} {'bf16 ms':>9} {'fp8 ms':>9} {'fp8/bf16':>9}")
    for m, k, n in sizes:
        x = torch.randn(m, k, device=device, dtype=BF16, requires_grad=True)
        w = torch.randn(n, k, device=device, requires_grad=True)

        def bf16_step(x=x, w=w) -> None:
            with torch.autocast(device, BF16):
                y = torch.nn.functional.linear(x, w)
            y.backward(torch.ones_like(y))

        def fp8_step(x=x, w=w) -> None:
            y = fp8_ops.linear(x, w)
            y.backward(torch.ones_like(y))

        steps = {"bf16": bf16_step, "fp8": fp8_step}
        for step in steps.values():
            step()
        med = _median_ms(steps, args.repeats, device)
        print(f"{f'{m}x{k}x{n}':<20} {med['bf16']:>9.2f} {med['fp8']:>9.2f} "
              f"{med['fp8'] / med['bf16']:>9.2f}")  # fmt: skip
    print()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=None,
        help="also torch.compile both (default: on CUDA only)",
    )  # fmt: skip
    parser.add_argument(
        "--threads", type=int, default=1,
        help="CPU intra-op threads (default 1: the VM's 2 cores are shared)",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.repeats = args.repeats or (3 if args.quick else 5 if args.device == "cpu" else 20)
    if args.compile is None:
        args.compile = args.device == "cuda"
    fp8_ops.require_fp8_matmul(args.device)  # a clear error on GPUs without float8 matmuls
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(
        f"torch {torch.__version__} on {args.device} ({name}), {torch.get_num_threads()} "
        f"threads; {args.repeats} interleaved repeats, medians\n"
    )
    gpt_section(args)
    linear_section(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
