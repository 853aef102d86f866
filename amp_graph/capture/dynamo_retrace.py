"""The torch.compile backend's capture: dynamo's graph retraced down to pre-dispatch aten ops.

Dynamo hands the backend a graph of torch-level calls, traced on fake values (with symbolic
sizes). :func:`capture_graph` runs it under ``make_fx(pre_dispatch=True)`` on those values,
so that composites become the aten ops the passes read, keeping what dynamo recorded about
each node and input, and each custom Function and custom op as one kept call
(:class:`~amp_graph.capture.autograd_functions.FunctionKeepingInterpreter`). The result is
the one IR the passes take: aten ops with a fake value on every node.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from amp_graph.capture.autograd_functions import AutocastState, FunctionKeepingInterpreter
from amp_graph.capture.capture_error import CaptureError
from amp_graph.capture.casts import mark_named, strip_aliases
from amp_graph.passes.meta import TRACED_NOOP_CAST, VAL


def capture_graph(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    function_autocast: AutocastState | None = None,
) -> fx.GraphModule:
    """Retrace a graph dynamo captured (torch-level calls) down to pre-dispatch aten ops.

    The torch.compile backend's capture: the graph runs under ``make_fx(pre_dispatch=True)``
    on the fake values dynamo traced it with (symbolic sizes included), so ops inside
    ``F.multi_head_attention_forward`` and other composites become aten ops, each keeping
    the ``nn_module_stack`` of the dynamo node it came from. What dynamo recorded about each
    input (``grapharg``: parameter or buffer sources) is carried over. Each custom autograd
    Function dynamo traced whole becomes one node that runs it under ``function_autocast``
    (the policy's torch.autocast; None: the state now), its own backward kept
    (:class:`~amp_graph.capture.autograd_functions.FunctionKeepingInterpreter`).
    """
    _refuse_functorch_transforms(gm)
    import torch.fx.traceback as fx_traceback
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # The tracing context's fake mode (dynamo's): faking a real input there gives back the
    # fake dynamo traced with, symbolic sizes included.
    fake_mode = detect_fake_mode(list(example_inputs)) or FakeTensorMode(allow_non_fake_inputs=True)
    values = []
    for node, value in zip(placeholders, example_inputs, strict=False):
        traced_with = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, FakeTensor) or not isinstance(value, torch.Tensor):
            values.append(traced_with if isinstance(traced_with, torch.SymInt) else value)
        else:
            values.append(fake_mode.from_tensor(value))

    aliases: set[str] = set()
    baked: set[str] = set()
    autocast = function_autocast or AutocastState.now()

    def run(*args: Any) -> Any:
        with fx_traceback.preserve_node_meta():
            return FunctionKeepingInterpreter(gm, aliases, baked, autocast).run(*args)

    with fake_mode:
        traced = make_fx(run, pre_dispatch=True)(*values)
    strip_aliases(traced, aliases)
    _give_empty_results_a_value(traced)
    carry_dynamo_records(gm, traced)
    mark_named(traced, baked, TRACED_NOOP_CAST)
    traced.recompile()
    return traced


def _give_empty_results_a_value(gm: fx.GraphModule) -> None:
    """``meta["val"] = None`` on each call of an op whose schema returns nothing (a custom op
    that writes into its inputs, vLLM's style): make_fx records no value for it, and the
    passes take a graph with a value on every op (its writes they read from the schema)."""
    for node in gm.graph.nodes:
        op = node.target
        empty = isinstance(op, torch._ops.OpOverload) and not op._schema.returns
        if node.op == "call_function" and empty and VAL not in node.meta:
            node.meta[VAL] = None


def carry_dynamo_records(gm: fx.GraphModule, traced: fx.GraphModule) -> None:
    """Give ``traced`` (a retrace of dynamo's ``gm``) dynamo's placeholder names and what
    dynamo recorded about each input (``grapharg``, ``example_value``), placeholder by
    placeholder in order, and ``gm``'s ``meta``. The caller recompiles ``traced``."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    new_placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    for old, new in zip(placeholders, new_placeholders, strict=False):
        for key in ("grapharg", "example_value"):
            if key in old.meta:
                new.meta[key] = old.meta[key]
        if hasattr(new, "_rename"):  # dynamo's names (l_x_) read better than arg0_1
            new._rename(old.name)
    traced.meta.update(getattr(gm, "meta", {}))


# functorch's transforms as dynamo inlines them (torch.vmap, torch.func.grad/jvp, and
# torch's associative_scan, which HF Mamba's slow path calls): make_fx cannot retrace their
# level bookkeeping, and the batched tensors would escape into the graph as constants
_FUNCTORCH_LEVELS = frozenset(
    {
        "_vmap_increment_nesting",
        "_grad_increment_nesting",
        "_jvp_increment_nesting",
        "_add_batch_dim",
    }
)


def _refuse_functorch_transforms(gm: fx.GraphModule) -> None:
    """Raise :class:`CaptureError` where dynamo's graph runs a functorch transform inline."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "__name__", "") in _FUNCTORCH_LEVELS:
            lines = [ln.strip() for ln in node.meta.get("stack_trace", "").splitlines()]
            torch_dir = torch.__file__.rsplit("/", 1)[0] + "/"
            files = [ln for ln in lines if ln.startswith("File") and torch_dir not in ln]
            where = files[-1] if files else ""  # the innermost frame of the model's code
            if any(_FLEX_ATTENTION_FILE in ln for ln in lines):
                raise CaptureError(_flex_block_mask_message(where))
            raise CaptureError(
                "amp_graph's torch.compile backend cannot retrace a graph that runs a functorch "
                "transform inline (torch.vmap, torch.func.grad or jvp, torch's associative_scan "
                f"as HF Mamba's slow path calls it){': ' + where if where else ''}. Use "
                "amp_graph.compile(model, ...) or amp_graph.Graph, which capture it with "
                "torch.export, or keep the transform out of the compiled region "
                "(torch.compiler.disable on the function that calls it)."
            )


# flex_attention's module: create_block_mask there runs torch.vmap over the mask function
_FLEX_ATTENTION_FILE = "torch/nn/attention/flex_attention.py"


def _flex_block_mask_message(where: str) -> str:
    return (
        "amp_graph's torch.compile backend cannot retrace flex_attention's block mask made "
        "inside the compiled forward (create_block_mask runs torch.vmap inline)"
        f"{': ' + where if where else ''}. Make the block mask outside the compiled region "
        "and pass it in (torchtitan makes its masks before the model's forward); the backend "
        "takes flex_attention itself. amp_graph.compile cannot capture flex_attention; an HF "
        "model can use attn_implementation='sdpa'."
    )


__all__ = ["capture_graph", "carry_dynamo_records"]
