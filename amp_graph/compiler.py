"""``amp_graph.compile``: capture a model as an FX graph and rewrite it for mixed precision."""

from __future__ import annotations

import linecache
import logging
import traceback
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from amp_graph.passes import AMP, Role, run_passes
from amp_graph.passes.meta import VAL, short
from amp_graph.policy import Policy, resolve_policy

log = logging.getLogger(__name__)

LOW_PRECISION_DTYPES = (torch.float16, torch.bfloat16)
COMPILE_META = "amp_graph"


class CaptureError(RuntimeError):
    """torch.fx.symbolic_trace could not capture the model."""


@dataclass
class CompileRecord:
    """What ``compile`` did, kept on ``compiled.meta["amp_graph"]`` for reports."""

    policy: Policy
    dtype: torch.dtype
    device_type: str
    stats: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    exact: bool = False  # dtypes come from example inputs (FakeTensor propagation)
    original: fx.GraphModule | None = None  # the captured graph before the passes, for diffs


def default_dtype(device_type: str) -> torch.dtype:
    """torch.autocast's default: float16 on CUDA, bfloat16 on CPU."""
    return torch.float16 if device_type == "cuda" else torch.bfloat16


def check_dtype(dtype: Any) -> torch.dtype:
    if dtype in LOW_PRECISION_DTYPES:
        return dtype
    hint = ""
    if dtype == torch.float32:
        hint = " For float32 everywhere use policy='O0'."
    elif isinstance(dtype, str):
        name = "bfloat16" if "b" in dtype else "float16"
        hint = f" Pass the torch dtype object, e.g. dtype=torch.{name}."
    raise ValueError(
        "dtype is the low-precision compute dtype, torch.float16 or torch.bfloat16; "
        f"got {dtype!r}.{hint}"
    )


def model_device_type(model: nn.Module, example_inputs: Sequence[Any] | None) -> str:
    """The device autocast would use: the model's parameters', else the inputs', else cpu."""
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device.type
    for value in example_inputs or ():
        if isinstance(value, torch.Tensor):
            return value.device.type
    return "cpu"


def _user_frame(error: BaseException) -> str:
    """``file.py:12: `if x.sum() > 0:``` for the innermost frame outside torch."""
    frames = traceback.extract_tb(error.__traceback__)
    torch_root = torch.__file__.rsplit("/", 2)[0]
    for frame in reversed(frames):
        if not frame.filename.startswith(torch_root) and frame.filename != __file__:
            code = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
            return f"{frame.filename}:{frame.lineno}: `{code}`"
    return "an unknown location"


def capture(model: nn.Module) -> fx.GraphModule:
    """``torch.fx.symbolic_trace(model)``, with errors that say what to do instead."""
    try:
        return fx.symbolic_trace(model)
    except Exception as error:
        where = _user_frame(error)
        raise CaptureError(
            f"torch.fx.symbolic_trace cannot capture {type(model).__name__}: "
            f"{type(error).__name__}: "
            f"{error}\n  The failing construct is at {where}.\n  Symbolic tracing cannot follow "
            "Python control flow or calls that depend on tensor values. Use "
            "torch.compile(model, backend='amp_graph'), which splits the model at such "
            "constructs, or capture the graph with another tracer and pass the "
            "torch.fx.GraphModule to amp_graph.compile."
        ).with_traceback(None) from error


def drop_string_annotations(gm: fx.GraphModule) -> None:
    """Forget annotations that are strings (``from __future__ import annotations``): as
    globals of the generated code they make the GraphModule unpicklable."""
    for node in gm.graph.nodes:
        if isinstance(node.type, str):
            node.type = None


def _copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule over a copy of ``gm``'s graph, sharing its submodules and tensors."""
    graph = fx.Graph(owning_module=None)
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    copied = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    copied.meta.update(getattr(gm, "meta", {}))
    return copied


def _attach_example_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not isinstance(example_inputs, (tuple, list)):
        raise TypeError(
            "example_inputs is a tuple of the forward's arguments, e.g. (x,); "
            f"got {type(example_inputs).__name__}"
        )
    if len(example_inputs) > len(placeholders):
        raise ValueError(
            f"{len(example_inputs)} example inputs for a graph with {len(placeholders)} inputs "
            f"({', '.join(p.name for p in placeholders)})"
        )
    if not any(isinstance(v, torch.Tensor) for v in example_inputs):
        raise ValueError(
            "none of example_inputs is a tensor; pass the tensors the model is called with"
        )
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    for node, value in zip(placeholders, example_inputs, strict=False):
        node.meta[VAL] = (
            mode.from_tensor(value, static_shapes=True)
            if isinstance(value, torch.Tensor)
            else value
        )
    for node in placeholders[len(example_inputs) :]:
        default = node.args[0] if node.args else None
        if isinstance(default, torch.Tensor):
            default = mode.from_tensor(default, static_shapes=True)
        node.meta[VAL] = default


def _summary(gm: fx.GraphModule, record: CompileRecord) -> str:
    dtypes = Counter(
        short(n.meta[AMP].out_dtype)
        for n in gm.graph.nodes
        if n.meta[AMP].role in (Role.OP, Role.USER_CAST, Role.INPLACE)
    )
    casts = sum(n.meta[AMP].role is Role.CAST for n in gm.graph.nodes)
    per_dtype = ", ".join(f"{count} {name}" for name, count in sorted(dtypes.items()))
    return (
        f"amp_graph.compile: policy {record.policy.name}, {short(record.dtype)}: ops by output "
        f"dtype {{{per_dtype}}}; casts inserted {record.stats.get('casts_inserted', 0)}, removed "
        f"{record.stats.get('casts_removed', 0)}, kept {casts}"
    )


def compile(
    model: nn.Module,
    policy: Policy | str = "O1",
    dtype: torch.dtype | None = None,
    *,
    example_inputs: Sequence[Any] | None = None,
    check_each_pass: bool = False,
) -> fx.GraphModule:
    """Rewrite ``model`` so that each op computes at the dtype ``policy`` gives it.

    Args:
        model: an ``nn.Module`` (captured with ``torch.fx.symbolic_trace``) or a
            ``torch.fx.GraphModule`` (used as is: bring graphs from other tracers).
        policy: a preset name (``"O0"``, ``"O1"``, ``"O2"``, ``"O3"``, ``"autocast"``) or an
            :class:`amp_graph.Policy`.
        dtype: the low-precision dtype, ``torch.float16`` or ``torch.bfloat16``; by default
            what torch.autocast uses on the model's device (float16 on CUDA, else bfloat16).
        example_inputs: the forward's arguments (a tuple). With them every dtype is proven
            by FakeTensor propagation and reports show bytes; without them, inputs' dtypes
            are unknown and casts of values derived only from them test the dtype at run
            time, exactly as torch.autocast does.
        check_each_pass: run the verifier after every pass (slower; the tests use it).

    Returns:
        A ``torch.fx.GraphModule`` sharing parameters and buffers with ``model``; ``model``
        itself is not modified. Print it, or see :func:`amp_graph.report`.

    Raises:
        CaptureError: symbolic tracing failed; the message names the construct.
        ValueError / TypeError: bad policy, dtype, overrides or example inputs.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            "amp_graph.compile takes an nn.Module or a torch.fx.GraphModule; "
            f"got {type(model).__name__}"
        )
    device_type = model_device_type(model, example_inputs)
    dtype = check_dtype(default_dtype(device_type) if dtype is None else dtype)
    policy = resolve_policy(policy, device_type)
    gm = _copy_graph_module(model) if isinstance(model, fx.GraphModule) else capture(model)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not placeholders:
        raise ValueError(
            f"the graph of {type(model).__name__} has no inputs, so there is nothing whose "
            "precision could change; amp_graph needs a model called with tensors"
        )
    drop_string_annotations(gm)
    if example_inputs is not None:
        _attach_example_inputs(gm, example_inputs)
    policy.validate_for(
        [name for name, _ in model.named_modules()], [n.name for n in gm.graph.nodes]
    )
    original = _copy_graph_module(gm)
    result = run_passes(gm, policy, dtype, check_each=check_each_pass)
    exact = bool(result.stats.get("exact_dtypes"))
    record = CompileRecord(
        policy, dtype, device_type, result.stats, result.seconds, exact, original
    )
    gm.meta[COMPILE_META] = record
    log.info("%s", _summary(gm, record))
    return gm


def compile_record(compiled: nn.Module) -> CompileRecord:
    """The record ``compile`` left on a compiled module; a clear error for other modules."""
    record = (
        getattr(compiled, "meta", {}).get(COMPILE_META)
        if isinstance(compiled, fx.GraphModule)
        else None
    )
    if record is None:
        raise TypeError(
            f"{type(compiled).__name__} was not produced by amp_graph.compile (or by the "
            "amp_graph backend); pass the module amp_graph.compile returned"
        )
    return record


__all__ = ["CaptureError", "CompileRecord", "capture", "compile", "compile_record"]
