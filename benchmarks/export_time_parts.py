"""Where amp_graph.export's time goes, against torch.export, on a deep GPT (issue 27).

Side by side in one run, each from a fresh ``amp_graph.demo.models.GPT`` (vocab 64, block 16,
dim 32, 2 heads, ``--layers`` layers, input 1x16, eval mode) after ``gc.collect()``, rounds
interleaved, after an untimed warm-up of each on a 2-layer GPT:

* ``torch.export``: the float32 model as is (the reference, 1.00);
* ``+ no_grad, GC paused``: the same under ``torch.no_grad()`` with Python's garbage
  collector paused (what amp_graph.export sets around its capture);
* ``+ autocast``: the same under ``torch.autocast("cpu", bfloat16)``, as the capture traces;
* ``+ code generated lazily``: the same with torch's lazy GraphModules, as amp_graph's
  capture exports (torch.export then generates Python code for its program only, not for
  the GraphModule of each of its own passes): the reference the capture is like-for-like with;
* amp_graph's capture (``capture_module``) alone, without a policy (the values keep
  autocast's dtypes) and with O1's (its dispatch mode gives each value the policy's dtype
  as the model's Python runs): what the planning mode costs the trace;
* ``amp_graph.export``: O1, bfloat16 (capture under the policy, passes, lift);
* ``amp_graph.export, GC not paused``: the same with amp_graph's pause switched off (this
  script replaces ``gc_paused`` in the two modules that use it, for this run only);
* ``amp_graph.export, pass-through mode``: the capture's dtype-planning mode replaced by one
  that only forwards each kernel (the values keep autocast's dtypes, so ``assign_dtypes``
  recomputes them): what the planning costs and what it saves.

Ratios are medians over the rounds, each against the same round's ``torch.export``.

    python benchmarks/export_time_parts.py                 # 140 layers, 3 rounds (~3 min)
    python benchmarks/export_time_parts.py --layers 28 --rounds 1   # smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from measure import cpu_name
from torch.fx._lazy_graph_module import _use_lazy_graph_module

import amp_graph
import amp_graph.capture as capture
import amp_graph.capture.planned_dtypes as capture_dtypes
import amp_graph.deploy.program as program
from amp_graph.demo import models
from amp_graph.policy import Policy


def gpt(layers: int) -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    model = models.GPT(vocab=64, block=16, dim=32, heads=2, layers=layers).eval()
    return model, (torch.randint(0, 64, (1, 16)),)


@contextlib.contextmanager
def no_gc_pause() -> Iterator[None]:
    saved = capture.gc_paused, program.gc_paused
    capture.gc_paused = program.gc_paused = contextlib.nullcontext  # type: ignore[assignment]
    try:
        yield
    finally:
        capture.gc_paused, program.gc_paused = saved


@contextlib.contextmanager
def pass_through_mode() -> Iterator[None]:
    cls = capture_dtypes.PolicyDtypeMode
    saved = cls.__torch_dispatch__

    def forward_only(self: Any, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        return func(*args, **(kwargs or {}))

    cls.__torch_dispatch__ = forward_only  # type: ignore[method-assign]
    try:
        yield
    finally:
        cls.__torch_dispatch__ = saved  # type: ignore[method-assign]


def torch_export(model: nn.Module, args: tuple) -> None:
    torch.export.export(model, args)


def torch_export_quiet(model: nn.Module, args: tuple) -> None:
    with torch.no_grad(), capture.gc_paused():
        torch.export.export(model, args)


def torch_export_autocast(model: nn.Module, args: tuple) -> None:
    with torch.no_grad(), capture.gc_paused(), torch.autocast("cpu", dtype=torch.bfloat16):
        torch.export.export(model, args)


def torch_export_lazy(model: nn.Module, args: tuple) -> None:
    with (
        torch.no_grad(),
        capture.gc_paused(),
        torch.autocast("cpu", dtype=torch.bfloat16),
        _use_lazy_graph_module(True),
    ):
        torch.export.export(model, args)


O1_INFERENCE = dataclasses.replace(Policy.preset("O1"), recompute_casts=False)


def capture_without_policy(model: nn.Module, args: tuple) -> None:
    with torch.no_grad():
        capture.capture_module(
            model, args, {}, device_type="cpu", autocast_dtype=torch.bfloat16, code_on_call=True
        )


def capture_with_policy(model: nn.Module, args: tuple) -> None:
    with torch.no_grad():
        capture.capture_module(
            model,
            args,
            {},
            device_type="cpu",
            autocast_dtype=torch.bfloat16,
            policy=O1_INFERENCE,
            low_dtype=torch.bfloat16,
            code_on_call=True,
        )


def ours(model: nn.Module, args: tuple) -> None:
    amp_graph.export(model, args, policy="O1", dtype=torch.bfloat16)


def ours_gc(model: nn.Module, args: tuple) -> None:
    with no_gc_pause():
        ours(model, args)


def ours_pass_through(model: nn.Module, args: tuple) -> None:
    with pass_through_mode():
        ours(model, args)


VARIANTS: dict[str, Callable[[nn.Module, tuple], None]] = {
    "torch.export": torch_export,
    "+ no_grad, GC paused": torch_export_quiet,
    "+ autocast": torch_export_autocast,
    "+ code generated lazily": torch_export_lazy,
    "amp_graph's capture, no policy (autocast's dtypes)": capture_without_policy,
    "amp_graph's capture, O1's dtype planning": capture_with_policy,
    "amp_graph.export": ours,
    "amp_graph.export, GC not paused": ours_gc,
    "amp_graph.export, pass-through mode": ours_pass_through,
}


def timed(run: Callable[[nn.Module, tuple], None], layers: int) -> float:
    model, args = gpt(layers)
    gc.collect()
    start = time.perf_counter()
    run(model, args)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=140)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(
        f"{cpu_name()}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; GPT {args.layers} layers; {args.rounds} rounds\n"
    )
    for run in VARIANTS.values():  # warm-up: torch.export's one-time start-up
        timed(run, 2)
    seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, run in VARIANTS.items():
            seconds[name].append(timed(run, args.layers))
    reference = seconds["torch.export"]
    print("| variant | median s | / torch.export (median of rounds) |")
    print("| --- | --- | --- |")
    for name, values in seconds.items():
        ratio = statistics.median(v / r for v, r in zip(values, reference, strict=True))
        print(f"| {name} | {statistics.median(values):.2f} | {ratio:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
