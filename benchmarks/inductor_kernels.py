"""What inductor generates for ``torch.compile(backend="amp_graph")`` against ``torch.compile``
under torch.autocast: kernels, the bytes each moves, and what the partitioner saves.

Issue 58 asks where the backend's time goes beside torch.compile's. This script compiles one
training step (forward with the loss, backward) of each model three or four ways and prints,
for the forward and the backward graphs inductor compiled:

* ``fused``: inductor's generated kernels (C++ on the CPU, Triton on CUDA), ``extern``: the
  library calls (matrix products, attention), each count with the bytes its kernels read and
  write (inductor's own estimate, ``Scheduler`` node by node: ``get_read_write_buffers_sizes``);
* ``casts``: fused kernels that do nothing but cast (a dtype conversion alone);
* ``saved``: the tensors the backward graph takes from the forward (what the partitioner
  keeps), parameters and activations apart, in MiB;
* the kernels one variant has and the reference has not (by their fused op names).

Variants: ``autocast`` (``torch.compile(model)`` called under ``torch.autocast``, the reference),
``amp_graph O1`` and ``amp_graph autocast`` (torch.autocast's own op lists through the
backend), ``amp_graph O1, every cast recomputed`` (``Policy(recompute_casts=True)``: each
cast tagged for recompute, what ``"auto"`` did under AOTAutograd before issue 58) and ``Graph
O1, enable_compile`` (an ``amp_graph.Graph`` step whose build inductor compiles: what the MFU
and the captured step run on a GPU). Nothing is timed: the counts do not depend on the load.

``--models llama``: fp8's kernels. A Llama stack (:class:`models.LlamaWithLoss`), its head kept
in bf16 as in ``fp8_step.py``, compiled as ``autocast`` (bf16, for scale), ``torchao fp8
tensorwise`` (``convert_to_float8_training``, then ``torch.compile`` under autocast: the
reference here) and ``amp_graph fp8 tensorwise`` (the ``"fp8"`` policy through the backend):
whether inductor fuses amp_graph's amax, scale and cast as it fuses torchao's. amp_graph's
``fp8_linear`` is one opaque call that takes the high-precision ``x`` and weight only for
their gradients; its kernel reads their float8 copies, so its bytes here leave those two out.

    python benchmarks/inductor_kernels.py                 # GPT and ConvNet, CPU (2-3 minutes)
    python benchmarks/inductor_kernels.py --models llama  # fp8 against torchao (3 minutes)
    python benchmarks/inductor_kernels.py --device cuda --models gpt --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch._inductor.config as inductor_config
from fp8_step import not_the_head  # the fp8 step's layer filter: the head stays bf16
from graph_bench import Setup, StepGraph, sgd
from torch._inductor import metrics
from torch._inductor.compile_fx import compile_fx, compile_fx_inner

import amp_graph
from amp_graph.demo import models

inductor_config.fx_graph_cache = False  # every graph is compiled, so its kernels are counted
MIB = 2**20


@dataclasses.dataclass
class GraphFigures:
    """One compiled graph (forward or backward)."""

    fused: int = 0
    fused_bytes: int = 0
    extern: int = 0
    extern_bytes: int = 0
    casts: int = 0
    cast_bytes: int = 0
    saved_parameter_bytes: int = 0
    saved_activation_bytes: int = 0
    kernels: list[str] = dataclasses.field(default_factory=list)


def _bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return 0


class Recorder:
    """An inner compile for ``compile_fx`` that records each graph's scheduler nodes and the
    backward's inputs (what the forward saved), then compiles as inductor does."""

    def __init__(self) -> None:
        self.graphs: dict[str, GraphFigures] = {}

    def inner(self, gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        kind = "backward" if kwargs.get("is_backward") else "forward"
        figures = self.graphs.setdefault(kind, GraphFigures())
        if kind == "backward":
            for node in gm.graph.nodes:
                if node.op != "placeholder" or node.name.startswith("tangents"):
                    continue
                size = _bytes(node.meta.get("val"))
                if node.name.startswith("primals"):
                    figures.saved_parameter_bytes += size
                else:
                    figures.saved_activation_bytes += size
        before = len(metrics.nodes_num_elem)
        compiled = compile_fx_inner(gm, example_inputs, **kwargs)
        for node, elements in metrics.nodes_num_elem[before:]:
            size = elements * 4 - _unread_bytes(node)  # inductor's count_bytes: bytes // 4
            name = _kernel_name(node)
            if node.is_extern():
                figures.extern += 1
                figures.extern_bytes += size
            else:
                figures.fused += 1
                figures.fused_bytes += size
                if name == "fused_convert_element_type":  # a kernel that only casts
                    figures.casts += 1
                    figures.cast_bytes += size
            figures.kernels.append(name)
        return compiled

    def backend(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        return compile_fx(gm, example_inputs, inner_compile=self.inner)


def _unread_bytes(node: Any) -> int:
    """Bytes inductor counts for an extern call that its kernel does not read: amp_graph's
    ``fp8_linear`` takes ``x`` and the weight for their gradients alone (the kernel reads
    their float8 copies, also arguments)."""
    kernel = getattr(node.node, "op_overload", None)
    if not node.is_extern() or str(kernel) != "amp_graph.fp8_linear.default":
        return 0
    unread = node.node.inputs[:2]  # x, weight: the schema's first two
    return sum(int(t.get_numel()) * t.get_dtype().itemsize for t in unread)


def _kernel_name(node: Any) -> str:
    """A scheduler node's kernel, named by the aten ops it fuses (as inductor names it) or
    by the extern call."""
    if node.is_extern():
        kernel = getattr(node.node, "python_kernel_name", None) or type(node.node).__name__
        return str(kernel).rsplit(".", 1)[-1]
    origins = set()
    for inner in node.get_nodes():
        for origin in getattr(inner.node, "origins", ()):
            if origin.op == "call_function":
                target = str(origin.target)  # aten.add.Tensor -> add
                origins.add(target.split(".")[-2] if "." in target else target)
    return "fused_" + "_".join(sorted(origins))


def _count_bytes_per_node() -> None:
    """Inductor counts each scheduler node's bytes only while its metrics log is enabled at
    INFO: enable it, and send its lines nowhere."""
    import logging

    from torch._inductor import compile_fx as inductor_compile_fx

    log = inductor_compile_fx.inductor_metrics_log
    log.setLevel(logging.INFO)
    log.propagate = False
    log.handlers[:] = [logging.NullHandler()]


def make(name: str, device: str) -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(0)
    if name == "gpt":
        large = device == "cuda"
        dims = dict(vocab=8192, block=512, dim=768, heads=12, layers=4) if large else dict(
            vocab=256, block=64, dim=128, heads=4, layers=2)  # fmt: skip
        model = models.GPTWithLoss(**dims).to(device)
        batch = 8 if large else 16
        idx = torch.randint(0, dims["vocab"], (batch, dims["block"]), device=device)
        return model, (idx, torch.roll(idx, -1, dims=1))
    if name == "llama":
        large = device == "cuda"
        dims = dict(vocab=32000, dim=4096, blocks=1, heads=32, hidden=14336) if large else dict(
            vocab=512, dim=256, blocks=2, heads=4, hidden=768)  # fmt: skip
        model = models.LlamaWithLoss(**dims).to(device)
        batch, seq = (2, 2048) if large else (8, 128)
        idx = torch.randint(0, dims["vocab"], (batch, seq), device=device)
        return model, (idx, torch.roll(idx, -1, dims=1))
    model = models.ConvNet(in_channels=1, channels=32, classes=10).to(device)
    images = torch.randn(64, 1, 28, 28, device=device)
    labels = torch.randint(0, 10, (64,), device=device)
    return models.WithCrossEntropy(model).to(device), (images, labels)


def variant_step(
    variant: str,
    model: torch.nn.Module,
    inputs: tuple,
    device: str,
    dtype: torch.dtype,
    recorder: Recorder,
) -> Callable[[], None]:
    if variant == "autocast":
        compiled = torch.compile(model, backend=recorder.backend)

        def step() -> None:
            with torch.autocast(device, dtype=dtype):
                loss = compiled(*inputs)
            loss.backward()

        return step
    if variant == "torchao fp8 tensorwise":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name("tensorwise")
        model = convert_to_float8_training(model, config=config, module_filter_fn=not_the_head)
        return variant_step("autocast", model, inputs, device, dtype, recorder)
    if variant == GRAPH_VARIANT:
        return graph_step(model, inputs, dtype, recorder)
    policy: Any = {"amp_graph O1": "O1", "amp_graph autocast": "autocast"}.get(variant)
    if variant == "amp_graph O1, every cast recomputed":
        policy = dataclasses.replace(amp_graph.Policy.preset("O1"), recompute_casts=True)
    if variant == "amp_graph fp8 tensorwise":
        fp8 = amp_graph.Policy.preset("fp8")
        policy = fp8.with_fp8(recipe="tensorwise", module_filter=not_the_head)
    backend = amp_graph.backend(policy, dtype, inner=recorder.backend)
    compiled = torch.compile(model, backend=backend)

    def step() -> None:
        compiled(*inputs).backward()

    return step


def graph_step(
    model: torch.nn.Module, inputs: tuple, dtype: torch.dtype, recorder: Recorder
) -> Callable[[], None]:
    """A ``Graph`` step (graph_bench's: the model returns its loss; fused SGD) with
    ``config.enable_compile()``: what the MFU and the captured step run on a GPU (the
    optimizer step stays eager, as in a hand-written loop)."""
    graph = StepGraph(Setup("inductor_kernels", model, sgd, inputs, gpt=True), model, "O1", dtype)
    graph.config.enable_compile(backend=recorder.backend)
    return lambda: graph(*inputs)


GRAPH_VARIANT = "Graph O1, enable_compile"
VARIANTS = (
    "autocast",
    "amp_graph O1",
    "amp_graph autocast",
    "amp_graph O1, every cast recomputed",
    GRAPH_VARIANT,
)
FP8_VARIANTS = ("autocast", "torchao fp8 tensorwise", "amp_graph fp8 tensorwise")
REFERENCE = {"llama": "torchao fp8 tensorwise"}  # the others: "autocast"


def measure(name: str, device: str, dtype: torch.dtype) -> dict[str, dict[str, GraphFigures]]:
    out = {}
    for variant in FP8_VARIANTS if name == "llama" else VARIANTS:
        torch._dynamo.reset()
        model, inputs = make(name, device)
        recorder = Recorder()
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the backend's note on a callable inner backend
            variant_step(variant, model, inputs, device, dtype, recorder)()
        out[variant] = recorder.graphs
    return out


def render(name: str, result: dict[str, dict[str, GraphFigures]]) -> str:
    lines = [f"== {name}"]
    head = (f"  {'variant':36s} {'graph':8s} {'fused':>5s} {'MiB':>7s} {'extern':>6s} {'MiB':>7s} "
            f"{'casts':>5s} {'MiB':>6s} {'saved: params':>13s} {'activations':>11s}")  # fmt: skip
    lines.append(head)
    for variant, graphs in result.items():
        for kind in ("forward", "backward"):
            g = graphs.get(kind)
            if g is None:
                continue
            lines.append(
                f"  {variant:36s} {kind:8s} {g.fused:5d} {g.fused_bytes / MIB:7.2f} {g.extern:6d} "
                f"{g.extern_bytes / MIB:7.2f} {g.casts:5d} {g.cast_bytes / MIB:6.2f} "
                f"{g.saved_parameter_bytes / MIB:13.2f} {g.saved_activation_bytes / MIB:11.2f}"
            )
    for variant, graphs in result.items():  # forward and backward together
        kept = list(graphs.values())
        fused, extern = sum(g.fused_bytes for g in kept), sum(g.extern_bytes for g in kept)
        kernels = sum(g.fused + g.extern for g in kept)
        lines.append(
            f"  {variant:36s} both     {kernels:4d} kernels, fused {fused / MIB:.2f} MiB + extern "
            f"{extern / MIB:.2f} MiB = {(fused + extern) / MIB:.2f} MiB"
        )
    reference_name = REFERENCE.get(name, "autocast")
    reference = result[reference_name]
    for variant, graphs in result.items():
        if variant in ("autocast", reference_name):
            continue
        for kind in ("forward", "backward"):
            ours = Counter(graphs.get(kind, GraphFigures()).kernels)
            theirs = Counter(reference.get(kind, GraphFigures()).kernels)
            extra, missing = ours - theirs, theirs - ours
            if extra or missing:
                lines.append(f"  {variant}, {kind}: more {dict(extra)}; fewer {dict(missing)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models", nargs="+", default=["gpt", "convnet"])
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    _count_bytes_per_node()
    dtype = torch.bfloat16
    report = {}
    for name in args.models:
        result = measure(name, args.device, dtype)
        print(render(name, result), flush=True)
        report[name] = {v: {k: dataclasses.asdict(g) for k, g in gs.items()}
                        for v, gs in result.items()}  # fmt: skip
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
