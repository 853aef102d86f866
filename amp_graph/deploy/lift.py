"""An ``ExportedProgram`` from a rewritten GraphModule, without tracing it again.

The capture is a ``torch.export`` program whose state placeholders the capture turned into
``get_attr`` reads of the model (:func:`amp_graph.capture.capture_module`); the passes then
rewrote that graph. This module turns the reads back into placeholders with torch.export's
signature (parameters, buffers, constants, then the user's inputs), reusing what the
capture recorded of the program (:class:`amp_graph.capture.ExportFacts`: its shape
symbols' ranges, call signature and verifier). Retracing the graph with ``torch.export``
instead would cost a second export, as long as the first.

State that every reader casts to one narrower dtype (:func:`passes.state_casts`) is stored
cast, and its casts leave the graph.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ConstantArgument,
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    TensorArgument,
)
from torch.fx.node import map_arg

from amp_graph.capture import EXPORT_FACTS, ExportFacts, set_dotted_attr
from amp_graph.passes.aten_casts import TO_COPY, cast_dtype
from amp_graph.passes.meta import AMP, MODEL_ROOT, VAL


class LiftError(RuntimeError):
    """The rewritten graph has something an inference program cannot hold."""


def _owner(root: nn.Module, target: str) -> tuple[Any, str]:
    path, _, name = target.rpartition(".")
    return (root.get_submodule(path) if path else root), name


def _kind(gm: fx.GraphModule, target: str, prefix: str) -> tuple[InputKind, str, bool]:
    """What torch.export calls this state: (kind, its name there, persistent)."""
    if not target.startswith(prefix):  # a constant the capture set on the GraphModule
        return InputKind.CONSTANT_TENSOR, target, True
    fqn = target[len(prefix) :]
    owner, name = _owner(gm, target)
    if name in owner._parameters:
        return InputKind.PARAMETER, fqn, True
    if name in owner._buffers:
        return InputKind.BUFFER, fqn, name not in owner._non_persistent_buffers_set
    return InputKind.CONSTANT_TENSOR, fqn, True


_PREFIX = {InputKind.PARAMETER: "p_", InputKind.BUFFER: "b_", InputKind.CONSTANT_TENSOR: "c_"}


def exported_program(
    gm: fx.GraphModule,
    stored_as: Mapping[str, torch.dtype],
    example_inputs: tuple[tuple, dict] | None,
) -> ExportedProgram:
    """The inference program of ``gm`` (a captured, rewritten GraphModule whose casts are
    aten ops): its state becomes the program's state, each ``stored_as`` target (a
    ``get_attr`` target) cast to its dtype there, and the casts reading it leave the graph.

    ``gm``'s graph becomes the program's, rewritten in place (a second copy of a deep
    model's graph would cost time and memory): ``gm`` is spent after the call.

    Raises:
        LiftError: the graph writes a parameter or buffer (not an inference graph), or
            ``gm`` was not captured by :func:`amp_graph.capture.capture_module`.
    """
    facts: ExportFacts | None = gm.meta.get(EXPORT_FACTS)
    if facts is None:
        raise LiftError("the GraphModule was not captured by amp_graph's torch.export capture")
    _fill_values(gm)
    graph = gm.graph
    root_attr = gm.meta.get(MODEL_ROOT, "")
    prefix = f"{root_attr}." if root_attr else ""
    input_specs: list[InputSpec] = []
    state_dict: dict[str, torch.Tensor] = {}
    constants: dict[str, Any] = {}
    modules: dict[str, nn.Module] = {}
    by_tensor: dict[int, fx.Node] = {}  # tied paths: one placeholder
    stored_low: set[fx.Node] = set()  # placeholders of state stored cast

    reads = [n for n in graph.nodes if n.op == "get_attr"]
    read_set = set(reads)
    for node in graph.nodes:
        _check_no_state_write(node, read_set)
    user_inputs = [n for n in graph.nodes if n.op == "placeholder"]
    first = next(n for n in graph.nodes if n.op != "get_attr")  # stays: reads are erased
    for node in reads:
        owner, name = _owner(gm, node.target)  # type: ignore[arg-type]
        value = getattr(owner, name)
        if isinstance(value, nn.Module):  # a subgraph a higher-order op calls
            modules[node.target] = value  # type: ignore[index]
            continue
        if not isinstance(value, torch.Tensor):
            raise LiftError(f"the graph reads {node.target!r}, a {type(value).__name__}")
        placeholder = by_tensor.get(id(value))
        if placeholder is None:
            kind, fqn, persistent = _kind(gm, node.target, prefix)  # type: ignore[arg-type]
            low = stored_as.get(node.target)  # type: ignore[call-overload]
            stored = value.detach().to(low) if low is not None else value
            with graph.inserting_before(first):
                placeholder = graph.placeholder(_PREFIX[kind] + fqn.replace(".", "_"))
            placeholder.meta = node.meta
            if low is not None:
                placeholder.meta[VAL] = next(iter(node.users)).meta[VAL]
                stored_low.add(placeholder)
            if kind is InputKind.PARAMETER:
                param = stored if low is None else nn.Parameter(stored, requires_grad=False)
                state_dict[fqn] = param
            elif kind is InputKind.BUFFER and persistent:
                state_dict[fqn] = stored
            else:
                constants[fqn] = stored
            input_specs.append(
                InputSpec(
                    kind,
                    TensorArgument(placeholder.name),
                    fqn,
                    persistent if kind is InputKind.BUFFER else None,
                )
            )
            by_tensor[id(value)] = placeholder
        node.replace_all_uses_with(placeholder)
        graph.erase_node(node)
    for node in list(graph.nodes):  # the stored tensor is the value of the casts reading it
        if node.args and node.args[0] in stored_low and cast_dtype(node) is not None:
            node.replace_all_uses_with(node.args[0])  # type: ignore[arg-type]
            graph.erase_node(node)
    for node in user_inputs:
        value = node.meta.get(VAL)
        argument = (
            TensorArgument(node.name)
            if isinstance(value, torch.Tensor)
            else ConstantArgument(node.name, value)
        )
        input_specs.append(InputSpec(InputKind.USER_INPUT, argument, None))
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    result = output.args[0]
    leaves = tuple(result) if isinstance(result, (tuple, list)) else (result,)
    output.args = (leaves,)
    output_specs = [
        OutputSpec(
            OutputKind.USER_OUTPUT,
            TensorArgument(v.name) if isinstance(v, fx.Node) else ConstantArgument("", v),
            None,
        )
        for v in leaves
    ]
    _user_inputs_last(graph)
    root = nn.Module()
    for target, module in modules.items():
        set_dotted_attr(root, target, module)
    return ExportedProgram(
        root=root,
        graph=graph,
        graph_signature=ExportGraphSignature(input_specs, output_specs),
        state_dict=state_dict,
        range_constraints=facts.range_constraints,
        module_call_graph=facts.module_call_graph,
        example_inputs=example_inputs,
        constants=constants,
        verifiers=facts.verifiers,
    )


def _stale(node: fx.Node) -> bool:
    """No example value, or one of another dtype than the passes decided."""
    value = node.meta.get(VAL)
    if value is None:
        return True
    amp = node.meta.get(AMP)
    planned = getattr(amp, "out_dtype", None)
    return (
        isinstance(value, torch.Tensor)
        and isinstance(planned, torch.dtype)
        and value.dtype != planned
    )


def _fill_values(gm: fx.GraphModule) -> None:
    """An example value on every call, as a program's nodes carry them (serialization and
    AOTInductor read them): computed on the capture's fake values where the passes added
    the node (their casts) or changed its dtype, and nowhere else (propagating through the
    whole graph would cost a pass)."""
    values = [n.meta[VAL] for n in gm.graph.nodes if isinstance(n.meta.get(VAL), torch.Tensor)]
    fake_mode = detect_fake_mode(values)
    for node in gm.graph.nodes:
        if node.op != "call_function" or not _stale(node):
            continue
        args, kwargs = map_arg((node.args, node.kwargs), lambda n: n.meta[VAL])
        cast = _cast_value(node, args, kwargs, fake_mode)
        if cast is not None:
            node.meta[VAL] = cast
            continue
        with fake_mode:
            node.meta[VAL] = node.target(*args, **kwargs)  # type: ignore[operator]


def _cast_value(node: fx.Node, args: tuple, kwargs: dict, fake_mode: Any) -> Any:
    """The value of ``_to_copy(x, dtype=d)`` (the casts the passes added) made directly: a
    fake tensor of x's sizes and strides in d, at a tenth of a fake kernel's cost (a deep
    model's export fills a thousand). None where the cast is another (a device, a layout,
    a symbolic size): the kernel computes that one."""
    if node.target is not TO_COPY or len(args) != 1 or set(kwargs) != {"dtype"}:
        return None
    value, dtype = args[0], kwargs["dtype"]
    if not isinstance(value, FakeTensor) or value.fake_mode is not fake_mode:
        return None
    sizes = (*value.shape, *value.stride())
    if not all(type(size) is int for size in sizes) or not value.is_contiguous():
        return None  # a copy of a strided view is laid out anew: the kernel knows how
    meta = torch.empty_strided(value.shape, value.stride(), dtype=dtype, device="meta")
    return FakeTensor(fake_mode, meta, value.device)


def _check_no_state_write(node: fx.Node, reads: set[fx.Node]) -> None:
    if (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and node.target._schema.is_mutable
        and node.args
        and node.args[0] in reads
    ):
        raise LiftError(
            f"the model writes {node.args[0].target!r} in its forward ({node.name}: "  # type: ignore[union-attr]
            f"{node.target}): an exported inference program holds no state it updates. "
            "Export the model in a form that does not update buffers when called in eval mode"
        )


def _user_inputs_last(graph: fx.Graph) -> None:
    """torch.export's order: state placeholders first (they were made first), then the user's."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    first_other = next(n for n in graph.nodes if n.op != "placeholder")
    for node in placeholders:
        first_other.prepend(node)
