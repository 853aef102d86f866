"""The whole training step as one CUDA graph (``Graph.config.enable_cuda_graph``) against the
loops a user would write, in one run, on the GPT-2-small shape (issue 41's targets).

    python benchmarks/cuda_graph_bench.py                         # needs a CUDA GPU
    python benchmarks/cuda_graph_bench.py --batch 8 --dtype bf16 --json out.json
    python benchmarks/cuda_graph_bench.py --device cpu --tiny     # the code path, no capture
    python benchmarks/cuda_graph_bench.py --host-overhead         # any machine

Setup: ``graph_bench.py``'s GPT (12 layers, dim 768, BATCH x 512 tokens, vocabulary 8192),
AdamW everywhere (fused; ``capturable=True`` and a device-tensor learning rate where a CUDA
graph replays it), float16 with a loss scaler (``init_scale=2**12``) or bfloat16. Variants,
timed in interleaved rounds (medians of the per-round ratio to the hand-written loop):

* ``hand``: the eager ``torch.autocast`` loop with ``torch.amp.GradScaler`` (fp16);
* ``torch.compile reduce-overhead``: the same loop over ``torch.compile(model,
  mode="reduce-overhead")`` (forward and backward in CUDA graphs; optimizer and scaler
  eager): the best torch-only loop (``--compile-dtype`` picks the dtypes: it compiles);
* ``amp_graph backend reduce-overhead``: the loop without autocast over ``torch.compile(model,
  backend=amp_graph.backend("O1", dtype), mode="reduce-overhead")`` (amp_graph's casts, then
  inductor with its CUDA graphs), measured with the torch.compile loop;
* ``compile O1`` and ``compile O1 cuda_graph``: the loop without autocast over
  ``amp_graph.compile(model, "O1", dtype)``, with ``mode="eager"`` and ``mode="cudagraphs"``
  (forward and backward replayed; optimizer and scaler eager);
* ``Graph O1``: ``amp_graph.Graph`` uncaptured;
* ``Graph O1 cuda_graph``: the same Graph with ``config.enable_cuda_graph(True)``;
* ``Graph O1 cuda_graph set_to_none``: with ``enable_cuda_graph(True, set_to_none=True)``:
  gradients set to None before the backward, each graph writing its own, instead of zeroed in
  place (no zeroing pass, no accumulating add, no gradients held beside the activations).

``--host-overhead``: what a replayed step still costs the host, on any machine: a Graph (the
tiny GPT, fused SGD) whose capture is replaced by one that keeps the outputs and whose replay
launches nothing, so that a call is the Graph's and the replayer's Python alone (the input
signature, the batch copied into the static inputs, the outputs copied out).

``--grad-zeroing`` (the CPU): what a captured step's gradients zeroed in place (the default)
cost beside ``set_to_none=True``'s, in peak bytes and time (:func:`grad_zeroing`).

``--graph-compile`` adds ``Graph O1 enable_compile cuda_graph``: the same Graph with
``config.enable_compile()`` (inductor's kernels for forward and backward) captured whole.

Memory: the bytes one step reserves beyond what the model, gradients and optimizer state
hold (:func:`step_peak_bytes`): reserved bytes on both sides, since a captured graph holds
its pool's segments whole. (The first GPU run compared the uncaptured step's peak allocated
bytes with the pool's segments: 1.29x, part of it the allocator's rounding, counted on one
side only.) Each row also gives every variant's first five calls' peak allocated bytes
(``first_calls_peak_alloc_mb``): for a captured Graph, calls 1-3 warm up and call 4
captures, so that the capture's own peak can be set beside the eager step's and beside its
pool's segments (on the H200 the pool held 1.69x the eager step's reserved peak, cause not
yet established), and a captured Graph's ``pool``: its segments' bytes by block state after
the capture (:func:`pool_breakdown`: kept tensors or free space the capture did not reuse).
``first_calls_reserved_mb``: the bytes reserved at the peak of the build and the first five
calls, cached blocks included (:func:`reserved_peak_since`): what the variant needs to get
going. A capture cannot use the blocks its warm-ups cached, so until amp_graph handed them
back before each capture (2026-12-06) a captured Graph's first calls reserved the eager
step's transient memory twice.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from graph_bench import DTYPES, Setup, StepGraph, handwritten, ratio
from measure import cpu_name, interleaved_seconds, release

import amp_graph
from amp_graph.demo import models


def gpt_setup(batch: int, device: str, tiny: bool) -> Setup:
    torch.manual_seed(0)
    seq, dim, heads, layers, vocab = (32, 64, 4, 2, 512) if tiny else (512, 768, 12, 12, 8192)
    model = models.GPTWithLoss(vocab=vocab, block=seq, dim=dim, heads=heads, layers=layers)
    idx = torch.randint(0, vocab, (batch, seq), device=device)
    targets = torch.randint(0, vocab, (batch, seq), device=device)
    name = f"GPT ({layers} layers, dim {dim}, {batch}x{seq} tokens)"
    return Setup(name, model.to(device), adamw, (idx, targets), True)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, fused=True)


def capturable_adamw(params: Any) -> torch.optim.Optimizer:
    params = list(params)
    lr = torch.tensor(1e-4, device=params[0].device)
    return torch.optim.AdamW(params, lr=lr, fused=True, capturable=True)


Built = tuple[Callable, Any]  # (the step, the Graph or None)


def variants(
    setup: Setup, dtype: torch.dtype, compiled: bool, capture: bool, graph_compile: bool = False
) -> dict[str, Callable[[], Built]]:
    """name -> what builds that variant's step (built one by one, so that one that fails to
    build or to run is reported beside the others' figures)."""

    def graph(captured: bool, inductor: bool = False, set_to_none: bool = False) -> Built:
        opt = capturable_adamw if captured else setup.optimizer
        graph_setup = Setup(setup.name, setup.model, opt, setup.inputs, True)
        step = StepGraph(graph_setup, copy.deepcopy(setup.model), "O1", dtype)
        if captured:
            step.config.enable_cuda_graph(True, set_to_none=set_to_none)
        if inductor:
            step.config.enable_compile()
        return step, step

    def user_loop(graphed: bool) -> Built:
        model = copy.deepcopy(setup.model)
        forward = amp_graph.compile(model, "O1", dtype, mode="cudagraphs" if graphed else "eager")
        return _compiled_loop(setup, model, dtype, forward=forward), None

    def torch_compiled(amp_graph_backend: bool) -> Built:
        model = copy.deepcopy(setup.model)
        return _compiled_loop(setup, model, dtype, amp_graph_backend=amp_graph_backend), None

    out: dict[str, Callable[[], Built]] = {
        "hand": lambda: (handwritten(setup, copy.deepcopy(setup.model), dtype), None)
    }
    if compiled:
        out["torch.compile reduce-overhead"] = lambda: torch_compiled(False)
        out["amp_graph backend reduce-overhead"] = lambda: torch_compiled(True)
    if capture:
        out["compile O1"] = lambda: user_loop(False)
        out["compile O1 cuda_graph"] = lambda: user_loop(True)
    out["Graph O1"] = lambda: graph(False)
    if capture:
        out["Graph O1 cuda_graph"] = lambda: graph(True)
        out["Graph O1 cuda_graph set_to_none"] = lambda: graph(True, set_to_none=True)
    if capture and graph_compile:
        out["Graph O1 enable_compile cuda_graph"] = lambda: graph(True, inductor=True)
    return out


def _compiled_loop(
    setup: Setup,
    model: torch.nn.Module,
    dtype: torch.dtype,
    amp_graph_backend: bool = False,
    forward: Callable | None = None,
) -> Callable:
    """The user's loop over ``forward`` (torch.compile with mode="reduce-overhead", inductor
    or the amp_graph backend, unless given): fused AdamW, torch's GradScaler in float16."""
    opt = adamw(model.parameters())
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**12, enabled=dtype == torch.float16)
    autocast = forward is None and not amp_graph_backend  # amp_graph's casts are in the graph
    if forward is None:
        backend = amp_graph.backend("O1", dtype) if amp_graph_backend else "inductor"
        forward = torch.compile(model, backend=backend, mode="reduce-overhead")

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype, enabled=autocast):
            loss = setup.loss(forward, x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.detach().clone()  # cudagraph trees overwrite it at the next replay

    return step


def captured_pool(graph: Any) -> Any | None:
    """The memory pool of a Graph's captured steps (``torch.cuda.graph_pool_handle()``), or
    None: not a Graph, no ``enable_cuda_graph``, or nothing captured yet."""
    builder = getattr(graph, "_builder", None)
    replayer = getattr(builder, "replayer", None)
    if replayer is None or not replayer.captures:
        return None
    return replayer.device._pool


def pool_segments(snapshot: list[dict[str, Any]], pool: Any | None) -> list[dict[str, Any]]:
    """The segments of ``torch.cuda.memory_snapshot()`` that belong to ``pool`` (none for
    None)."""
    if pool is None:
        return []
    return [s for s in snapshot if s.get("segment_pool_id") == pool]


def segments_breakdown(segments: list[dict[str, Any]]) -> dict[str, Any]:
    """Segments' MiB by block state (``active_allocated``: tensors alive in the pool, the
    graph's outputs and anything the capture kept; ``inactive``: free space the capture never
    reused) and the sizes of the largest blocks of each state, to tell kept tensors from
    fragmentation."""
    by_state: dict[str, float] = {}
    largest: dict[str, list[float]] = {}
    for segment in segments:
        for block in segment["blocks"]:
            mib = block["size"] / 2**20
            by_state[block["state"]] = by_state.get(block["state"], 0.0) + mib
            largest.setdefault(block["state"], []).append(mib)
    return {
        "segments": len(segments),
        "segment_mib": sorted((s["total_size"] / 2**20 for s in segments), reverse=True)[:12],
        "mib_by_state": by_state,
        "largest_blocks_mib": {k: sorted(v, reverse=True)[:12] for k, v in largest.items()},
    }


def step_peak_bytes(step: Callable, graph: Any, inputs: tuple) -> int | None:
    """The device memory one step reserves beyond what is held between steps (None on the
    CPU): the allocator's reserved bytes at the step's peak, after ``empty_cache``, less those
    it still reserves outside a captured Graph's pool before the step. Reserved, not allocated,
    bytes on both sides, because a captured graph holds its pool's segments whole (a replay
    allocates nothing the allocator sees); for ``torch.compile``'s CUDA graphs, whose pool
    this cannot tell apart, the figure leaves their pool out."""
    if inputs[0].device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    segments = pool_segments(torch.cuda.memory_snapshot(), captured_pool(graph))
    held = torch.cuda.memory_reserved() - sum(s["total_size"] for s in segments)
    torch.cuda.reset_peak_memory_stats()
    step(*inputs)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_reserved() - held


def pool_breakdown(graph: Any) -> dict[str, Any] | None:
    """What a captured Graph's memory pool holds after its capture
    (:func:`segments_breakdown`), or None when nothing is captured."""
    pool = captured_pool(graph)
    if pool is None:
        return None
    return segments_breakdown(pool_segments(torch.cuda.memory_snapshot(), pool))


def allocated_peak(step: Callable, inputs: tuple) -> float | None:
    """Runs one step; the MiB it allocated at its peak beyond what was allocated before
    (None on the CPU). A capture's allocations count (they come from its pool)."""
    if inputs[0].device.type != "cuda":
        step(*inputs)
        return None
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(*inputs)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - held) / 2**20


def reserved_from_here(device: str) -> int | None:
    """Starts a count of what the allocator reserves from here on (None on the CPU): the
    cache emptied, the peak reset; returns the bytes reserved now."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_reserved()


def reserved_peak_since(start: int | None) -> float | None:
    """The MiB the allocator reserved at its peak since :func:`reserved_from_here` returned
    ``start``, beyond ``start`` (None on the CPU). Over a variant's first calls this counts
    its cached blocks too: a captured Graph's warm-ups cache blocks that its capture's pool
    cannot use, which ``step_peak_bytes`` (after ``empty_cache``) does not see."""
    if start is None:
        return None
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_reserved() - start) / 2**20


def measure(
    setup: Setup,
    dtype: torch.dtype,
    compiled: bool,
    repeats: int,
    graph_compile: bool = False,
    only: list[str] | None = None,
) -> dict[str, Any]:
    device = setup.inputs[0].device.type
    row: dict[str, Any] = {"setup": setup.name, "dtype": str(dtype).removeprefix("torch.")}
    steps: dict[str, Built] = {}
    peaks: dict[str, int | None] = {}
    call_peaks: dict[str, list[float | None]] = {}
    first_reserved: dict[str, float | None] = {}
    pools: dict[str, Any] = {}
    built = variants(setup, dtype, compiled, device == "cuda", graph_compile and compiled)
    for name, build in built.items():
        if only and name != "hand" and name not in only:
            continue
        try:
            start = reserved_from_here(device)
            step, graph = build()
            # warm-up steps, the capture, compilation: each call's peak allocated bytes,
            # the capture's included (what a captured graph's pool has to hold at least)
            call_peaks[name] = [allocated_peak(step, setup.inputs) for _ in range(5)]
            first_reserved[name] = reserved_peak_since(start)
            peaks[name] = step_peak_bytes(step, graph, setup.inputs)
            if device == "cuda":
                pools[name] = pool_breakdown(graph)
            steps[name] = step, graph
        except Exception as error:  # reported in the row; the other variants still run
            traceback.print_exc()
            row[name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            if device == "cuda":
                torch.cuda.synchronize()
    if "hand" not in steps:
        return row
    calls = {name: (lambda s=step: s(*setup.inputs)) for name, (step, _) in steps.items()}
    times = interleaved_seconds(calls, repeats, device=device)
    for name in steps:
        row[name] = {
            "ms": statistics.median(times[name]) * 1e3,
            "vs_hand": ratio(times, name, "hand"),
            "peak_step_mb": None if peaks[name] is None else peaks[name] / 2**20,
            "first_calls_peak_alloc_mb": call_peaks[name],
            "first_calls_reserved_mb": first_reserved[name],
            "pool": pools.get(name),
        }
    for mine, key in (
        ("Graph O1 cuda_graph", "captured_vs_compile"),
        ("Graph O1 enable_compile cuda_graph", "compiled_captured_vs_compile"),
    ):
        if "torch.compile reduce-overhead" in steps and mine in steps:
            row[key] = ratio(times, mine, "torch.compile reduce-overhead")
    if "Graph O1 cuda_graph" in steps and "Graph O1 cuda_graph set_to_none" in steps:
        row["set_to_none_vs_in_place"] = ratio(
            times, "Graph O1 cuda_graph set_to_none", "Graph O1 cuda_graph"
        )
    return row


class _NoLaunch:
    """A capture that computes the step once and whose replays launch nothing."""

    def check_devices(self, named: Any) -> None:
        pass

    def warmup(self, fn: Callable[[], Any]) -> Any:
        return fn()

    def capture(self, fn: Callable[[], Any]) -> Any:
        return fn()

    def replay(self, outputs: Any) -> Any:
        return outputs

    def release(self) -> None:
        pass


def host_overhead(repeats: int) -> dict[str, float]:
    """Microseconds of host time per replayed Graph call, and per plain step for scale."""
    import time

    setup = gpt_setup(4, "cpu", tiny=True)
    captured_setup = Setup(setup.name, setup.model, fused_sgd_cpu, setup.inputs, True)

    class NoLaunchGraph(StepGraph):
        _step_capture = _NoLaunch

    graph = NoLaunchGraph(captured_setup, copy.deepcopy(setup.model), "O1", torch.bfloat16)
    graph.config.enable_cuda_graph(True, warmup_steps=1)
    eager = StepGraph(setup, copy.deepcopy(setup.model), "O1", torch.bfloat16)
    out: dict[str, float] = {}
    for name, step in (("replayed call", graph), ("uncaptured step", eager)):
        for _ in range(3):
            step(*setup.inputs)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            step(*setup.inputs)
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times) * 1e6
    return out


class _RunEach(_NoLaunch):
    """A capture that runs the step at its capture and at every replay: the captured step's
    own Python, eagerly (its gradients zeroed in place or set to None, as its
    ``enable_cuda_graph(set_to_none=...)`` says)."""

    def capture(self, fn: Callable[[], Any]) -> Any:
        return fn

    def replay(self, fn: Any) -> Any:
        return fn()


def grad_zeroing(repeats: int) -> dict[str, Any]:
    """What zeroing the gradients in place (a captured Graph's default) costs beside setting
    them to None (``set_to_none=True``), on the CPU: the captured step's Python run eagerly
    both ways (a stand-in capture); each step's peak of allocated bytes from its start
    (:func:`measure.peak_cpu_next_step_mb`) and its time in interleaved rounds. To None, a
    step frees the last step's gradients before its forward, whose activations take their
    place; in place, they stay beside the activations, and each step zeroes them and adds
    each new gradient into them. GPT 4 layers, width 256, vocabulary 8192, 8x128 tokens, O1
    bf16, fused SGD."""
    from measure import peak_cpu_next_step_mb

    torch.manual_seed(0)
    model = models.GPTWithLoss(vocab=8192, block=128, dim=256, heads=4, layers=4)
    idx = torch.randint(0, 8192, (8, 128))
    setup = Setup("GPT 4x256, 8x128 tokens", model, fused_sgd_cpu, (idx, idx), True)

    class RunEachGraph(StepGraph):
        _step_capture = _RunEach

    steps = {}
    for name, set_to_none in (("to None", True), ("in place", False)):
        step = RunEachGraph(setup, copy.deepcopy(model), "O1", torch.bfloat16)
        step.config.enable_cuda_graph(True, warmup_steps=1, set_to_none=set_to_none)
        steps[name] = step
    for step in steps.values():
        for _ in range(3):  # the warm-up, the capture and a replay: the step's state exists
            step(*setup.inputs)
    grads = sum(p.numel() * 4 for p in model.parameters()) / 2**20
    peaks = {
        name: peak_cpu_next_step_mb(lambda s=step: s(*setup.inputs)) for name, step in steps.items()
    }
    calls = {name: (lambda s=step: s(*setup.inputs)) for name, step in steps.items()}
    times = interleaved_seconds(calls, repeats, device="cpu")
    return {
        "setup": setup.name,
        "gradients_mb": grads,
        "peak_mb": peaks,
        "ms": {name: statistics.median(t) * 1e3 for name, t in times.items()},
        "in_place_vs_to_none": ratio(times, "in place", "to None"),
    }


def fused_sgd_cpu(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=torch.tensor(1e-3), momentum=0.9, fused=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp16"])
    parser.add_argument("--compile-dtype", nargs="*", choices=sorted(DTYPES), default=["bf16"])
    parser.add_argument(
        "--compile-batch", type=int, nargs="*", default=[8], help="batches that compile"
    )
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer GPT (a quick check)")
    parser.add_argument(
        "--graph-compile",
        action="store_true",
        help="also Graph O1 with enable_compile() under enable_cuda_graph (inductor's kernels)",
    )
    parser.add_argument(
        "--only", nargs="*", default=None, help="these variants alone (and the hand loop)"
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--host-overhead", action="store_true", help="see the docstring")
    parser.add_argument("--grad-zeroing", action="store_true", help="see the docstring")
    args = parser.parse_args(argv)
    if args.grad_zeroing:
        figures = grad_zeroing(args.repeats)
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cpu_name()}")
        print(
            f"{figures['setup']}, O1 bf16, fused SGD; "
            f"fp32 gradients {figures['gradients_mb']:.1f} MB"
        )
        for name, peak in figures["peak_mb"].items():
            print(f"gradients {name:<9} step peak {peak:>7.1f} MB  {figures['ms'][name]:>8.2f} ms")
        print(
            f"in place / to None: {figures['in_place_vs_to_none']:.3f} (median of per-round ratios)"
        )
        if args.json:
            args.json.write_text(json.dumps(figures, indent=1))
        return 0
    if args.host_overhead:
        figures = host_overhead(args.repeats * 10)
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, tiny GPT, fused SGD")
        for name, us in figures.items():
            print(f"{name:<20} {us:>9.1f} us (median of {args.repeats * 10})")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("cuda_graph_bench.py needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 2
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (no capture)"
    print(f"torch {torch.__version__} on {where}; {args.repeats} interleaved rounds, medians")
    rows = []
    for batch in args.batch:
        setup = gpt_setup(batch, args.device, args.tiny)
        for name in args.dtype:
            compiled = args.device == "cuda" and name in args.compile_dtype
            compiled = compiled and batch in args.compile_batch
            row = measure(
                setup, DTYPES[name], compiled, args.repeats, args.graph_compile, args.only
            )
            rows.append(row)
            release(args.device)  # this row's Graphs, compiled models and pools
            print(f"== {row['setup']}, {row['dtype']}, AdamW")
            for variant, cell in row.items():
                if isinstance(cell, dict) and "error" in cell:
                    print(f"{variant:<32} FAILED: {cell['error']}")
                elif isinstance(cell, dict):
                    peak, first = cell["peak_step_mb"], cell["first_calls_reserved_mb"]
                    print(
                        f"{variant:<32} {cell['ms']:>9.2f} ms {cell['vs_hand']:>7.3f}x hand"
                        + ("" if peak is None else f"   step peak {peak:>8.1f} MB")
                        + ("" if first is None else f"   first calls {first:>8.1f} MB")
                    )
            for key in ("captured_vs_compile", "compiled_captured_vs_compile"):
                if key in row:
                    print(f"{key} (/ torch.compile reduce-overhead): {row[key]:.3f}")
            if "set_to_none_vs_in_place" in row:
                print(f"set_to_none / in place: {row['set_to_none_vs_in_place']:.3f}")
            if args.json:  # after each row: a run cut short still leaves its figures
                args.json.write_text(json.dumps(rows, indent=1))
    failed = any(isinstance(c, dict) and "error" in c for row in rows for c in row.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
