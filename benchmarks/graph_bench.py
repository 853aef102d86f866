"""amp_graph.Graph's training step against hand-written torch.autocast loops, in one run.

Setups (bf16 on a CPU by default; fused optimizers everywhere, hand-written loops included):

* GPT-style decoder with SGD (momentum 0.9) and with AdamW; the demo's BatchNorm ConvNet
  (width 32, 8x8 images, batch 128) with AdamW; ``--medium`` adds a larger GPT with AdamW;
  ``--large [BATCH]`` a GPT-2-small-sized one (12 layers, dim 768, BATCH x 512 tokens, 8 by
  default; vocabulary 8192, about 92M parameters) with AdamW, for a GPU, where the small ones
  are bound by Python and kernel launches (on an H100 8 sequences still are: the GPU works
  11 ms of a 32 ms step; 64 keep it busy); ``--only TEXT`` keeps the setups whose name contains it.

Sections:

1. **Step time**: a hand-written ``torch.autocast`` loop (with ``torch.amp.GradScaler`` in
   fp16) against ``amp_graph.Graph`` with policy ``"autocast"``, O1 and O2. Ratios are the
   median over rounds of (variant / hand-written) within a round; rounds are interleaved.
   Host reads per step: ``.item()``/``bool()`` (aten ``_local_scalar_dense``), ``.tolist()``,
   ``.cpu()`` and ``.numpy()`` calls during one step (on a GPU each is a synchronization).
   params+grads MB: parameters and gradients after a step, plus O2's float32 masters and
   their gradients. GEMM share and rest: from a profile of 10 more steps, the share of CPU time
   spent inside the matmul/convolution/attention kernels (which every variant runs alike, in
   the low-precision dtype) and the time per step outside them, with its ratio to the
   hand-written loop's: the part of the step an AMP implementation can change.
2. **Compiled**: ``torch.compile(model)`` under ``torch.autocast`` by hand, against a Graph
   with ``config.enable_compile()`` (inductor), with the first call's time (compilation; no
   inductor cache, after inductor's one-time start-up).
3. **Gradient accumulation (4 micro-batches)**: bytes that dtype casts read and write in one
   step, split into weights (forward casts of parameters, O2's copy back), weight gradients
   (backward casts of tensors shaped like a parameter) and the rest (activations), against
   the hand-written loop that runs ``torch.autocast`` per micro-batch; and the step time.

    python benchmarks/graph_bench.py                 # the run recorded in BENCHMARKS.md
    python benchmarks/graph_bench.py --quick
    python benchmarks/graph_bench.py --device cuda --dtype fp16
    python benchmarks/graph_bench.py --device cuda --dtype bf16 --large 64 --only "12 layers"
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from measure import interleaved_seconds
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from amp_graph.demo import models
from amp_graph.policy import Policy
from amp_graph.scaler import GradScaler
from amp_graph.training.nn_graph import Graph

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Setup:
    name: str
    model: torch.nn.Module
    optimizer: Callable[[Any], torch.optim.Optimizer]
    inputs: tuple[torch.Tensor, torch.Tensor]
    gpt: bool  # the model returns its loss (GPTWithLoss); else cross-entropy of its logits
    sections: frozenset[str] = frozenset({"step"})  # also "compiled", "accumulation"

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return model(x, y) if self.gpt else F.cross_entropy(model(x).float(), y)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9, fused=True)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, fused=True)


def setups(device: str, quick: bool, medium: bool, large: int | None) -> list[Setup]:
    torch.manual_seed(0)
    out = []
    all_sections = frozenset({"step", "compiled", "accumulation"})
    # name: (batch, tokens, dim, heads, layers, vocabulary)
    gpts = {"GPT (2 layers, dim 64, 4x32 tokens)": (4, 32, 64, 8, 2, 512)}
    if medium:
        gpts["GPT (2 layers, dim 128, 8x64 tokens)"] = (8, 64, 128, 8, 2, 512)
    if large:
        gpts[f"GPT (12 layers, dim 768, {large}x512 tokens)"] = (large, 512, 768, 12, 12, 8192)
    for i, (name, (batch, seq, dim, heads, layers, vocab)) in enumerate(gpts.items()):
        base = models.GPTWithLoss(vocab=vocab, block=seq, dim=dim, heads=heads, layers=layers)
        idx = torch.randint(0, vocab, (batch, seq), device=device)
        targets = torch.randint(0, vocab, (batch, seq), device=device)
        for opt in [adamw] if i else [sgd, adamw]:
            sections = all_sections if (i == 0 and opt is adamw) else frozenset({"step"})
            out.append(
                Setup(
                    f"{name}, {opt.__name__}",
                    base.to(device),
                    opt,
                    (idx, targets),
                    True,
                    sections,
                )
            )
    batch = 32 if quick else 128
    x = torch.randn(batch, 1, 8, 8, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    convnet = models.ConvNet(channels=32).to(device)
    name = f"ConvNet (demo's, width 32, batch {batch}), adamw"
    out.append(Setup(name, convnet, adamw, (x, y), False, frozenset({"step", "compiled"})))
    return out


class StepGraph(Graph):
    def __init__(
        self, setup: Setup, model: torch.nn.Module, policy: str | Policy, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.model = model
        self.setup = setup
        self.add_optimizer(setup.optimizer(model.parameters()))
        self.config.enable_amp(True, policy=policy, dtype=dtype)
        if dtype == torch.float16:
            self.set_grad_scaler(GradScaler(init_scale=2.0**12))

    def build(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.setup.loss(self.model, x, y)
        loss.backward()
        return loss


def handwritten(
    setup: Setup, model: torch.nn.Module, dtype: torch.dtype, micro_batches: int = 1,
    compiled: bool = False,
) -> Callable:  # fmt: skip
    """The loop one writes with torch.autocast (and torch.amp.GradScaler for fp16)."""
    device = setup.inputs[0].device.type
    opt = setup.optimizer(model.parameters())
    scaler = torch.amp.GradScaler(device, init_scale=2.0**12, enabled=dtype == torch.float16)
    forward = torch.compile(model) if compiled else model

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        losses = []
        for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True):
            with torch.autocast(device, dtype):
                loss = setup.loss(forward, xs, ys)
            scaler.scale(loss / micro_batches).backward()
            losses.append(loss.detach())
        scaler.step(opt)
        scaler.update()
        return torch.stack(losses).mean()

    return step


# ---- measurements ----------------------------------------------------------------------------


class _LocalScalars(TorchDispatchMode):
    def __init__(self, device: str) -> None:
        super().__init__()
        self.device, self.count = device, 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        if (
            func is torch.ops.aten._local_scalar_dense.default
            and args[0].device.type == self.device
        ):
            self.count += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def host_reads(device: str) -> Iterator[list[int]]:
    """Counts .item()/bool() (the dispatch mode) and .tolist()/.cpu()/.numpy() (patched) of
    tensors on ``device``. Not of host tensors on a GPU run: the scaler's warning reads a
    pinned host mirror its event says has landed, which waits for nothing."""
    counts = [0]
    with contextlib.ExitStack() as stack:
        for name in ("tolist", "cpu", "numpy"):
            original = getattr(torch.Tensor, name)

            def counting(self: torch.Tensor, *a: Any, _original: Any = original, **k: Any) -> Any:
                counts[0] += self.device.type == device
                return _original(self, *a, **k)

            stack.enter_context(mock.patch.object(torch.Tensor, name, counting))
        mode = stack.enter_context(_LocalScalars(device))
        yield counts
        counts[0] += mode.count


class CastBytes(TorchDispatchMode):
    """Bytes read and written by dtype casts: _to_copy, and copy_/_foreach_copy_ between
    dtypes. ``weights``: casts reading a parameter (or O2 master); ``weight grads``: casts in
    backward of tensors shaped like a parameter; ``activations``: the rest."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__()
        self.storages = {p.untyped_storage().data_ptr() for p in params}
        self.shapes = {tuple(p.shape) for p in params}
        self.bytes = {"weights": 0, "weight grads": 0, "activations": 0}

    def _count(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        if src.dtype == dst.dtype:
            return
        size = src.numel() * src.element_size() + dst.numel() * dst.element_size()
        if src.untyped_storage().data_ptr() in self.storages:
            kind = "weights"
        elif torch._C._current_graph_task_id() != -1 and tuple(src.shape) in self.shapes:
            kind = "weight grads"
        else:
            kind = "activations"
        self.bytes[kind] += size

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default:
            self._count(args[0], out)
        elif func is torch.ops.aten.copy_.default:
            self._count(args[1], args[0])
        elif func is torch.ops.aten._foreach_copy_.default:
            for dst, src in zip(args[0], args[1], strict=True):
                self._count(src, dst)
        return out


# The kernels that do the arithmetic of matmuls, convolutions and attention (self time only).
GEMM_KERNELS = frozenset(
    {
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::baddbmm",
        "aten::_slow_conv2d_forward",
        "aten::_slow_conv2d_backward",
        "aten::mkldnn_convolution",
        "aten::convolution_backward",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    }
)


def gemm_split(step: Callable, inputs: tuple, steps: int = 10) -> tuple[float, float]:
    """(share of CPU self time in GEMM_KERNELS, seconds per step outside them), profiled."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step(*inputs)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    gemm = sum(e.self_cpu_time_total for e in events if e.key in GEMM_KERNELS)
    return gemm / total, (total - gemm) / steps / 1e6


def param_grad_bytes(model: torch.nn.Module, graph: Graph | None) -> int:
    tensors = [t for p in model.parameters() for t in (p, p.grad) if t is not None]
    if graph is not None and graph._builder.master is not None:
        tensors += [
            t for _, _, m in graph._builder.master.pairs for t in (m, m.grad) if t is not None
        ]
    return sum(t.numel() * t.element_size() for t in tensors)


def interleaved(
    steps: dict[str, Callable], inputs: tuple, repeats: int, device: str
) -> dict[str, list[float]]:
    calls = {name: functools.partial(step, *inputs) for name, step in steps.items()}
    return interleaved_seconds(calls, repeats, device=device)


def ratio(times: dict[str, list[float]], name: str, ref: str) -> float:
    return statistics.median(a / b for a, b in zip(times[name], times[ref], strict=True))


# ---- sections --------------------------------------------------------------------------------


def step_time(setup: Setup, dtype: torch.dtype, repeats: int, device: str) -> None:
    hand = "hand-written autocast"
    variants: dict[str, tuple[Callable, torch.nn.Module, Graph | None]] = {}
    model = copy.deepcopy(setup.model)
    variants[hand] = (handwritten(setup, model, dtype), model, None)
    keeping = dataclasses.replace(Policy.preset("O1"), recompute_casts=False)
    for label, policy in (
        ("autocast", "autocast"),
        ("O1", "O1"),
        ("O1, casts kept", keeping),  # what the recompute of casts costs in time
        ("O2", "O2"),
    ):
        model = copy.deepcopy(setup.model)
        graph = StepGraph(setup, model, policy, dtype)
        variants[f"Graph {label}"] = (graph, model, graph)
    reads, memory = {}, {}
    for name, (step, model, graph) in variants.items():
        step(*setup.inputs)  # capture / warm up
        with host_reads(device) as counted:
            step(*setup.inputs)
        reads[name] = counted[0]
        memory[name] = param_grad_bytes(model, graph)
    times = interleaved({k: v[0] for k, v in variants.items()}, setup.inputs, repeats, device)
    split = {name: gemm_split(v[0], setup.inputs) for name, v in variants.items()}
    print(f"== {setup.name}: train step, {dtype}")
    print(
        f"{'variant':<24} {'median ms':>10} {'vs hand-written':>16} {'host reads/step':>16} "
        f"{'params+grads MB':>16} {'GEMM share':>11} {'rest ms':>8} {'vs hand':>8}"
    )
    for name in variants:
        share, rest = split[name]
        print(
            f"{name:<24} {statistics.median(times[name]) * 1e3:>10.2f} "
            f"{ratio(times, name, hand):>16.3f} {reads[name]:>16} {memory[name] / 2**20:>16.2f} "
            f"{share:>11.1%} {rest * 1e3:>8.2f} {rest / split[hand][1]:>8.2f}"
        )
    print()


def compiled(setup: Setup, dtype: torch.dtype, repeats: int, device: str) -> None:
    hand = "torch.compile + autocast"
    steps: dict[str, Callable] = {}
    first: dict[str, float] = {}
    model = copy.deepcopy(setup.model)
    steps[hand] = handwritten(setup, model, dtype, compiled=True)
    for policy in ("autocast", "O2"):
        model = copy.deepcopy(setup.model)
        graph = StepGraph(setup, model, policy, dtype)
        graph.config.enable_compile()
        steps[f"Graph {policy} compiled"] = graph
    # first-call times: inductor's one-time start-up paid before, no cache shared between them
    torch._inductor.config.fx_graph_cache = False
    torch.compile(lambda t: t * 2)(torch.ones(2, device=device))
    for name, step in steps.items():
        torch._dynamo.reset()
        start = time.perf_counter()
        step(*setup.inputs)
        first[name] = time.perf_counter() - start
        step(*setup.inputs)
    times = interleaved(steps, setup.inputs, repeats, device)
    print(f"== {setup.name}: compiled train step (inductor), {dtype}")
    print(f"{'variant':<26} {'median ms':>10} {'vs hand-written':>16} {'first call s':>13}")
    for name in steps:
        print(
            f"{name:<26} {statistics.median(times[name]) * 1e3:>10.2f} "
            f"{ratio(times, name, hand):>16.3f} {first[name]:>13.1f}"
        )
    print()


def accumulation(setup: Setup, dtype: torch.dtype, repeats: int, device: str) -> None:
    micro = 4
    hand = "hand-written autocast"
    steps: dict[str, Callable] = {}
    casts: dict[str, dict[str, int]] = {}
    model = copy.deepcopy(setup.model)
    steps[hand] = handwritten(setup, model, dtype, micro_batches=micro)
    params = {hand: list(model.parameters())}
    for policy in ("autocast", "O2"):
        model = copy.deepcopy(setup.model)
        graph = StepGraph(setup, model, policy, dtype)
        graph.config.set_gradient_accumulation_steps(micro)
        steps[f"Graph {policy}"] = graph
        params[f"Graph {policy}"] = list(model.parameters())
    for name, step in steps.items():
        step(*setup.inputs)
        if isinstance(step, Graph) and step._master is not None:
            params[name] += [m for _, _, m in step._master.pairs]
        with CastBytes(params[name]) as counter:
            step(*setup.inputs)
        casts[name] = counter.bytes
    times = interleaved(steps, setup.inputs, repeats, device)
    print(f"== {setup.name}: {micro} micro-batches per step, {dtype}; MB cast per step")
    print(
        f"{'variant':<24} {'weights':>9} {'vs hand':>8} {'weight grads':>13} {'vs hand':>8} "
        f"{'activations':>12} {'step ms':>9} {'vs hand':>8}"
    )
    ref = casts[hand]
    for name in steps:
        mb = {k: v / 2**20 for k, v in casts[name].items()}
        print(
            f"{name:<24} {mb['weights']:>9.2f} {casts[name]['weights'] / ref['weights']:>8.2f} "
            f"{mb['weight grads']:>13.2f} "
            f"{casts[name]['weight grads'] / max(ref['weight grads'], 1):>8.2f} "
            f"{mb['activations']:>12.2f} {statistics.median(times[name]) * 1e3:>9.2f} "
            f"{ratio(times, name, hand):>8.3f}"
        )
    print()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--medium", action="store_true", help="add a larger GPT (slow on CPU)")
    parser.add_argument(
        "--large", nargs="?", type=int, const=8, default=None, metavar="BATCH",
        help="add a GPT-2-small-sized GPT, BATCH sequences of 512 tokens (8; for a GPU)",
    )  # fmt: skip
    parser.add_argument("--only", default=None, help="keep the setups whose name contains it")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled section")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    dtype = DTYPES[args.dtype or ("fp16" if device == "cuda" else "bf16")]
    repeats = args.repeats or (4 if args.quick else 20)
    print(
        f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads; "
        f"{repeats} interleaved rounds, medians; fused SGD (momentum 0.9) / AdamW everywhere\n"
    )
    all_setups = setups(device, args.quick, args.medium, args.large)
    if args.only:
        all_setups = [s for s in all_setups if args.only in s.name]
        if not all_setups:
            parser.error(f"--only {args.only!r} matches no setup")
    for setup in all_setups:
        step_time(setup, dtype, repeats, device)
    for setup in all_setups:
        if "compiled" in setup.sections and not args.no_compile:
            compiled(setup, dtype, repeats, device)
    for setup in all_setups:
        if "accumulation" in setup.sections:
            accumulation(setup, dtype, repeats, device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
