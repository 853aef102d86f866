"""The modes of ``amp_graph.compile(model, policy, mode=...)`` against the eager torch.autocast
loop and torch.compile's own, side by side in one run: what the default (``mode=None``) is
chosen by.

One training step each (forward with the loss, backward, fused-or-foreach AdamW step):

* ``autocast eager``: the model called under ``torch.autocast``, the reference, and
  ``[again]``, the same a second time: its ratio is the measurement's noise floor;
* ``torch.compile + autocast`` (and ``... reduce-overhead`` on CUDA): torch's own;
* ``compile <mode>``: ``amp_graph.compile(model, "O1", mode=<mode>)`` for each mode this device
  runs (``eager``, ``default``, and on CUDA ``cudagraphs`` and ``reduce-overhead``); the row
  marked ``*`` is what ``mode=None`` gives on this device;
* ``Graph`` and ``Graph enable_compile``: the same step as an ``amp_graph.Graph`` (O1, the
  optimizer's step and ``zero_grad`` inside it), as it is by default (marked ``*``) and with
  ``config.enable_compile()`` (inductor): the figures that decide whether the Graph's default
  should follow ``amp_graph.compile``'s on this device.

Printed per variant: the median step, the median over rounds of its ratio to the reference's
step in the same round, and the first call's seconds (capture, passes, inductor's compile,
one step; each variant compiles into a fresh inductor cache, after a throwaway compile has
loaded inductor and started its workers, so every first call is a cold compile and none
profits from another's kernels). With ``--cold default`` only the default's first call is
cold: it runs first, in the run's own fresh cache, and the variants after it may reuse its
kernels (their first calls are marked ``w``); gpu-check uses it, for which five cold inductor
compiles on a GPU would not fit its stage. The report is rewritten after each variant's first
calls, so that a run cut short keeps them. Each variant's next two calls (where reduce-overhead
records and first replays its CUDA graphs) run before the timed rounds, so that a variant
that fails in them is reported in its row. The target: the default's ratio at most 1.0 on
every setup measured.

    python benchmarks/compile_modes.py --device cpu              # about 4 minutes here
    python benchmarks/compile_modes.py --device cuda --json out.json
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

# an inductor cache of this run's own (before torch reads the variable), removed when the run
# ends; each variant's first compile also gets a fresh one inside it (cold_compile)
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    RUN_CACHE = tempfile.mkdtemp(prefix="amp_graph_modes_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = RUN_CACHE
    atexit.register(shutil.rmtree, RUN_CACHE, ignore_errors=True)

import torch
from graph_bench import Setup, StepGraph
from measure import cpu_name, interleaved_seconds, sync

import amp_graph
from amp_graph.demo import models
from amp_graph.frontends.compile_modes import default_mode

Step = Callable[[], Any]


def setups(
    device: str, tiny: bool, layers: int | None
) -> dict[str, tuple[torch.nn.Module, tuple, str]]:
    """name -> (model, inputs, shape), built on ``device``; ``layers`` overrides the GPT's."""
    torch.manual_seed(0)
    if device == "cuda" and not tiny:
        gpt = dict(vocab=8192, block=512, dim=768, heads=12, layers=12)
        batch, conv_batch = 8, 256
    elif tiny:
        gpt = dict(vocab=256, block=32, dim=64, heads=4, layers=1)
        batch, conv_batch = 4, 8
    else:
        gpt = dict(vocab=512, block=128, dim=256, heads=8, layers=4)
        batch, conv_batch = 16, 64
    gpt["layers"] = layers or gpt["layers"]
    idx = torch.randint(0, gpt["vocab"], (batch, gpt["block"]), device=device)
    targets = torch.roll(idx, -1, dims=1)
    out = {
        "gpt": (
            models.GPTWithLoss(**gpt).to(device),
            (idx, targets),
            f"GPT {gpt['layers']} layers, width {gpt['dim']}, {batch}x{gpt['block']} tokens",
        ),
    }
    convnet = models.WithCrossEntropy(models.ConvNet(in_channels=3, channels=64)).to(device)
    images = torch.randn(conv_batch, 3, 32, 32, device=device)
    labels = torch.randint(0, 10, (conv_batch,), device=device)
    out["convnet"] = (convnet, (images, labels), f"ConvNet width 64, {conv_batch}x3x32x32")
    return out


def train_step(
    forward: Callable[..., torch.Tensor],
    model: torch.nn.Module,
    inputs: tuple,
    autocast: torch.dtype | None,
    device: str,
) -> Step:
    """One step of ``forward`` (returning the loss) with AdamW over ``model``'s parameters."""
    opt = adamw(device)(model.parameters())

    def step() -> None:
        if autocast is not None:
            with torch.autocast(device, dtype=autocast):
                loss = forward(*inputs)
        else:
            loss = forward(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


GRAPH_DEFAULT = "Graph"  # the Graph as it comes: uncompiled on every device


def adamw(device: str) -> Callable[[Any], torch.optim.Optimizer]:
    """Every variant's optimizer, given its parameters: fused AdamW on CUDA, foreach
    elsewhere."""
    return lambda params: torch.optim.AdamW(
        params, lr=1e-4, foreach=device != "cuda", fused=device == "cuda"
    )


def variants(
    model: torch.nn.Module, inputs: tuple, dtype: torch.dtype, device: str
) -> dict[str, Callable[[], Step]]:
    """name -> what builds that variant's step (each over its own copy of the model, so that
    the optimizers' updates do not meet)."""
    import copy

    def fresh() -> torch.nn.Module:
        return copy.deepcopy(model)

    def autocast_eager() -> Step:
        m = fresh()
        return train_step(m, m, inputs, dtype, device)

    def torch_compile(mode: str) -> Callable[[], Step]:
        def build() -> Step:
            m = fresh()
            return train_step(torch.compile(m, mode=mode), m, inputs, dtype, device)

        return build

    def ours(mode: str) -> Callable[[], Step]:
        def build() -> Step:
            m = fresh()
            return train_step(amp_graph.compile(m, "O1", dtype, mode=mode), m, inputs, None, device)

        return build

    out: dict[str, Callable[[], Step]] = {
        "autocast eager": autocast_eager,
        "autocast eager [again]": autocast_eager,  # an A/A row: the noise floor
        "torch.compile + autocast": torch_compile("default"),
    }
    modes = ["eager", "default"]
    if device == "cuda":
        out["torch.compile reduce-overhead + autocast"] = torch_compile("reduce-overhead")
        modes += ["cudagraphs", "reduce-overhead"]
    for mode in modes:
        out[f"compile {mode}"] = ours(mode)

    def graph(compiled: bool) -> Callable[[], Step]:
        def build() -> Step:
            m = fresh()  # each model here returns its loss
            step = StepGraph(Setup("compile_modes", m, adamw(device), inputs, True), m, "O1", dtype)
            if compiled:
                step.config.enable_compile()
            return lambda: step(*inputs)

        return build

    out[GRAPH_DEFAULT] = graph(False)
    out["Graph enable_compile"] = graph(True)
    return out


def cold_compile() -> contextlib.AbstractContextManager:
    """A fresh inductor (and Triton) cache around one variant's first call, kept on disk (its
    kernels load from there) inside the run's cache directory."""
    from torch._inductor import utils

    fresh = getattr(utils, "fresh_cache", None) or utils.fresh_inductor_cache
    return fresh(dir=os.environ["TORCHINDUCTOR_CACHE_DIR"], delete=False)


def start_inductor(device: str) -> None:
    """One throwaway compile, forward and backward: inductor's imports and its compile
    workers are paid for here, not by whichever variant compiles first."""
    layer = torch.nn.Linear(8, 8, device=device)
    with cold_compile():
        torch.compile(layer)(torch.randn(4, 8, device=device)).sum().backward()
    torch._dynamo.reset()


COLD = ("every", "default")  # --cold: whose first call compiles into a fresh cache


def build_order(built: list[str], chosen: str, cold: str) -> list[str]:
    """The order the variants are built and first called in: as listed, but with ``cold ==
    "default"`` the default first, cold in the run's own fresh cache, so that the variants
    after it reuse its kernels (part 2: torch.compile's are the same one for one)."""
    return sorted(built, key=lambda variant: variant != chosen) if cold == "default" else built


def measure(
    name: str,
    model: torch.nn.Module,
    inputs: tuple,
    dtype: torch.dtype,
    device: str,
    repeats: int,
    cold: str = "every",
    progress: Callable[[dict[str, Any]], None] = lambda partial: None,
) -> dict[str, Any]:
    """The model's rows. ``progress`` gets the rows so far after each variant's first calls
    (first call only), so that a run cut short keeps them."""
    built = variants(model, inputs, dtype, device)
    chosen = f"compile {default_mode(device)}"
    steps: dict[str, Step] = {}
    first: dict[str, dict[str, Any]] = {}
    failed: dict[str, dict[str, str]] = {}
    for variant in build_order(list(built), chosen, cold):
        warm = cold == "default" and variant != chosen  # may reuse the default's kernels
        try:
            with contextlib.nullcontext() if cold == "default" else cold_compile():
                step = built[variant]()
                sync(device)
                start = time.perf_counter()
                step()
                sync(device)
                seconds = time.perf_counter() - start
            first[variant] = {
                "first_call_s": seconds,
                "first_call_warm": warm,
                "default": variant in (chosen, GRAPH_DEFAULT),
            }
            for _ in range(2):  # reduce-overhead records its CUDA graphs, then replays them
                step()
        except Exception as error:  # reported in its row; the others are measured
            if variant == "autocast eager":
                raise  # the reference: nothing to compare with
            first.pop(variant, None)
            failed[variant] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        else:
            steps[variant] = step
        progress({"model": name, "rows": listed(built, first | failed)})
    try:
        times = interleaved_seconds(steps, repeats, warmup=2, device=device)
    except Exception as error:  # the rounds of all variants together: say so in every row
        message = f"interleaved rounds: {type(error).__name__}: {str(error)[:300]}"
        return {"model": name, "rows": {v: {"error": message} for v in built}}
    reference = times["autocast eager"]
    rows = {}
    for variant, seconds in times.items():
        ratios = [s / r for s, r in zip(seconds, reference, strict=True)]
        rows[variant] = {
            "median_ms": statistics.median(seconds) * 1e3,
            "vs_autocast_eager": statistics.median(ratios),
            **first[variant],
        }
    return {"model": name, "rows": listed(built, rows | failed)}


def listed(built: dict[str, Any], rows: dict[str, Any]) -> dict[str, Any]:
    """``rows`` in the variants' listed order (the order they were built in may differ)."""
    return {variant: rows[variant] for variant in built if variant in rows}


def render(result: dict[str, Any], shape: str) -> str:
    lines = [
        f"== {result['model']}: {shape}",
        f"  {'variant':42s} {'median ms':>10s} {'/ autocast eager':>17s} {'first call s':>13s}",
    ]
    for variant, row in result["rows"].items():
        if "error" in row:
            lines.append(f"  {variant:42s} FAILED: {row['error']}")
            continue
        mark = " *" if row["default"] else "  "
        warm = "w" if row["first_call_warm"] else " "
        lines.append(
            f"{mark}{variant:42s} {row['median_ms']:10.2f} {row['vs_autocast_eager']:17.3f} "
            f"{row['first_call_s']:12.1f}{warm}"
        )
    if any(row.get("first_call_warm") for row in result["rows"].values()):
        lines.append("  (w: a first call that may reuse the default's kernels: --cold default)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--models", nargs="+", default=["gpt", "convnet"])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: the code path only")
    parser.add_argument("--layers", type=int, help="the GPT's layers (12 on CUDA, 4 on the CPU)")
    parser.add_argument(
        "--cold",
        choices=COLD,
        default="every",
        help="whose first call compiles cold: every variant's (each in a fresh cache), or the "
        "default's alone (first; the others may reuse its kernels: quicker, for gpu-check)",
    )
    parser.add_argument(
        "--json", help="write the figures here (rewritten after each variant's first call)"
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("compile_modes.py --device cuda needs a CUDA GPU", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    where = torch.cuda.get_device_name() if args.device == "cuda" else cpu_name()
    print(
        f"{where}; torch {torch.__version__}; {torch.get_num_threads()} threads; "
        f"{args.dtype}; * = the defaults on {args.device}: compile's mode=None "
        f"({default_mode(args.device)}) and the Graph as it comes (uncompiled)"
    )
    results: list[dict[str, Any]] = []

    def write(partial: dict[str, Any] | None = None) -> None:
        if args.json:  # a run cut short keeps what it measured
            done = results + ([partial] if partial else [])
            with open(args.json, "w") as out:
                report = {"device": where, "torch": torch.__version__, "results": done}
                json.dump(report, out, indent=1)

    start_inductor(args.device)
    for name, (model, inputs, shape) in setups(args.device, args.tiny, args.layers).items():
        if name not in args.models:
            continue
        result = measure(
            name, model, inputs, dtype, args.device, args.repeats, args.cold,
            progress=lambda partial, shape=shape: write(partial | {"shape": shape}),
        )  # fmt: skip
        result["shape"] = shape
        print(render(result, shape), flush=True)
        results.append(result)
        write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
