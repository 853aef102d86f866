"""amp_graph.Graph's training step against a hand-written torch.autocast loop, in one run.

On the GPT-style decoder (fused Adam everywhere):
  * a hand-written ``torch.autocast`` loop (with ``torch.amp.GradScaler`` in fp16) vs
    ``amp_graph.Graph`` O1 and O2 (with ``amp_graph.GradScaler`` in fp16);
  * by default bf16 on a CPU and fp16 on a GPU (``--dtypes bf16,fp16`` for both; fp16 on a
    CPU without fp16 arithmetic is very slow);
median step times and ratios (interleaved repeats), host reads of device values per step
(aten ``_local_scalar_dense``: on a GPU each is a synchronization), and the bytes held by
parameters and gradients (plus O2's float32 master weights) right after backward.

    python benchmarks/graph_bench.py          # the run recorded in BENCHMARKS.md
    python benchmarks/graph_bench.py --quick
    python benchmarks/graph_bench.py --device cuda --dtypes fp16
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from amp_graph import models
from amp_graph.graph import Graph
from amp_graph.scaler import GradScaler


class GPTStep(Graph):
    def __init__(
        self, model: torch.nn.Module, opt: torch.optim.Optimizer, policy: str, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(opt)
        self.config.enable_amp(True, policy=policy, dtype=dtype)
        if dtype == torch.float16:
            self.set_grad_scaler(GradScaler(init_scale=2.0**12))

    def build(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.model(idx, targets)
        loss.backward()
        return loss


def handwritten(model: torch.nn.Module, dtype: torch.dtype, device: str) -> Callable:
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**12, enabled=dtype == torch.float16)

    def step(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype):
            loss = model(idx, targets)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    return step


class HostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        if func.overloadpacket is torch.ops.aten._local_scalar_dense:
            self.count += 1
        return func(*args, **(kwargs or {}))


def param_grad_bytes(model: torch.nn.Module, graph: Graph | None) -> int:
    total = 0
    for p in model.parameters():
        total += p.numel() * p.element_size()
        if p.grad is not None:
            total += p.grad.numel() * p.grad.element_size()
    if graph is not None and graph._master is not None:
        sizes = graph._master.parameter_bytes()
        total += sizes["master"] + sizes["master_grads"]
    return total


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtypes", default=None, help="comma-separated: bf16,fp16")
    args = parser.parse_args()
    device = args.device
    names = args.dtypes or ("fp16" if device == "cuda" else "bf16")
    dtypes = [{"bf16": torch.bfloat16, "fp16": torch.float16}[n] for n in names.split(",")]
    repeats = args.repeats or (4 if args.quick else 20)
    batch, seq, dim, layers = (4, 32, 64, 2) if args.quick else (16, 128, 256, 4)
    torch.manual_seed(0)
    base = models.GPTWithLoss(vocab=512, block=seq, dim=dim, heads=8, layers=layers).to(device)
    idx = torch.randint(0, 512, (batch, seq), device=device)
    targets = torch.randint(0, 512, (batch, seq), device=device)
    print(
        f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads; "
        f"GPT {layers} layers, "
        f"dim {dim}, batch {batch}x{seq}; {repeats} interleaved repeats, medians\n"
    )

    for dtype in dtypes:
        variants: dict[str, tuple[Callable, torch.nn.Module, Graph | None]] = {}
        model = copy.deepcopy(base)
        variants["hand-written autocast"] = (handwritten(model, dtype, device), model, None)
        for policy in ("O1", "O2"):
            model = copy.deepcopy(base)
            opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)
            graph = GPTStep(model, opt, policy, dtype)
            variants[f"amp_graph.Graph {policy}"] = (graph, model, graph)
        reads, memory = {}, {}
        for name, (step, model, graph) in variants.items():
            step(idx, targets)  # compile / warm up
            counter = HostReads()
            with counter:
                step(idx, targets)
            reads[name] = counter.count
            memory[name] = param_grad_bytes(model, graph)
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(repeats):
            for name, (step, _, _) in variants.items():
                if device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                step(idx, targets)
                if device == "cuda":
                    torch.cuda.synchronize()
                times[name].append(time.perf_counter() - start)
        med = {k: statistics.median(v) for k, v in times.items()}
        ref = med["hand-written autocast"]
        print(f"== {dtype}: train step")
        print(
            f"{'variant':<24} {'median ms':>10} {'vs hand-written':>16} {'host reads/step':>16} "
            f"{'params+grads MB':>16}"
        )
        for name in variants:
            print(
                f"{name:<24} {med[name] * 1e3:>10.2f} {med[name] / ref:>16.2f} {reads[name]:>16} "
                f"{memory[name] / 2**20:>16.2f}"
            )
        print()
    _ = F  # keep the import for readers adapting the loss
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
