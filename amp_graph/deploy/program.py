"""``amp_graph.export``: the mixed-precision inference program of a model, as a
``torch.export.ExportedProgram``.

The model is captured and rewritten exactly as :func:`amp_graph.compile` does in eval mode
(the same capture, policy and passes), then made an ExportedProgram directly from the
rewritten graph (:mod:`amp_graph.deploy.lift`): every cast is an aten ``_to_copy`` in the
graph, and every parameter or buffer that only low-precision ops read is stored in the low
dtype. So the program computes what ``amp_graph.compile(model.eval())`` computes under
``torch.no_grad()``, bit for bit, from about half the bytes of state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.export import ExportedProgram

from amp_graph.accuracy.autopolicy_search import AutopolicyError, as_call, autopolicy, default_tol
from amp_graph.accuracy.float32_error import OutputError, output_error
from amp_graph.capture import gc_paused
from amp_graph.frontends.compiler import CompiledModule, compiled_in_place
from amp_graph.frontends.front_door import COMPILE_META, admit, capture_and_rewrite
from amp_graph.frontends.model_forwards import class_forward
from amp_graph.frontends.policy_request import AmpRequest
from amp_graph.passes.aten_casts import aten_casts
from amp_graph.passes.casts_before_views import casts_before_views
from amp_graph.passes.meta import AMP, MODEL_ROOT, VAL, Role, short
from amp_graph.passes.state_casts import state_casts
from amp_graph.policy import Policy, Rule

from .custom_op_bodies import refuse_autocast_dependent_ops
from .lift import exported_program

INFO = "amp_graph.export"  # ep.graph_module.meta key of the ExportInfo


@dataclass(frozen=True)
class Island:
    """An op the program computes in float32, and why."""

    node: str
    op: str
    module_path: str
    why: str


@dataclass
class ExportInfo:
    """What :func:`export` decided: read it with :func:`export_info`.

    ``demoted``: the nodes calibration kept in float32, each with its evidence;
    ``stored_low``: each parameter or buffer stored in the low dtype, and that dtype;
    ``islands``: every op computed in float32 and why; ``casts``: the casts in the program;
    ``seconds``: calibration, the capture, the passes (compile's, then the export's
    ``aten_casts`` and ``state_casts``) and the lifting.
    """

    policy: Policy
    dtype: torch.dtype
    demoted: dict[str, str] = field(default_factory=dict)
    stored_low: dict[str, torch.dtype] = field(default_factory=dict)
    islands: list[Island] = field(default_factory=list)
    casts: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    # with calibration: the program's worst output error against the float32 model on the
    # samples (checked to be within tol)
    calibration_error: OutputError | None = None

    def summary(self) -> str:
        by_dtype: dict[str, int] = {}
        for dtype in self.stored_low.values():
            by_dtype[short(dtype)] = by_dtype.get(short(dtype), 0) + 1
        stored = ", ".join(f"{n} in {d}" for d, n in by_dtype.items()) or "none low"
        lines = [
            f"policy {self.policy.name}, dtype {short(self.dtype)}: {self.casts} casts, "
            f"state stored {stored}, {len(self.islands)} float32 ops"
        ]
        lines += [f"  demoted by calibration: {n}: {why}" for n, why in self.demoted.items()]
        return "\n".join(lines)


def export_info(program: ExportedProgram) -> ExportInfo:
    """The :class:`ExportInfo` of a program :func:`export` made (in this process)."""
    info = program.graph_module.meta.get(INFO)
    if info is None:
        raise ValueError(
            "this ExportedProgram was not made by amp_graph.export in this process (a loaded "
            "program keeps its record in the file: amp_graph.deploy.load_info(path))"
        )
    return info


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode, its modules' own flags restored after."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in flags:
            module.training = training


def _structure(args: tuple, kwargs: dict) -> pytree.TreeSpec:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    kinds = ["Tensor" if isinstance(v, torch.Tensor) else type(v).__name__ for v in leaves]
    return spec, kinds  # type: ignore[return-value]


def _describe(args: tuple, kwargs: dict) -> str:
    def one(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return f"Tensor{list(value.shape)} {short(value.dtype)}"
        if isinstance(value, (tuple, list)):
            return f"({', '.join(one(v) for v in value)})"
        return type(value).__name__

    parts = [one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]
    return f"({', '.join(parts)})"


def calibration_samples(
    model: nn.Module,
    calibration: Iterable[Any],
    args: tuple,
    kwargs: dict,
    dynamic_shapes: Any = None,
) -> list[tuple[tuple, dict]]:
    """The calibration samples as (args, kwargs), each checked against the forward's
    signature, the structure of the export's example inputs, and the shapes the program
    will take (the example's, but where ``dynamic_shapes`` lets a size vary).

    Raises:
        TypeError: naming the sample, what it is, and the signature it must fit.
        ValueError: naming the sample, the input whose shape the program will not take,
            and the example's shape.
    """
    if isinstance(calibration, (torch.Tensor, dict)) or not isinstance(calibration, Iterable):
        raise TypeError(
            "calibration is an iterable of sample inputs (a list of tuples of forward "
            f"arguments, or of dicts of keyword arguments); got {type(calibration).__name__}"
        )
    signature = inspect.signature(model.forward)
    expected = _structure(args, kwargs)
    where = f"{type(model).__name__}.forward{signature}"
    ranges = _dynamic_ranges(model, args, kwargs, dynamic_shapes)
    samples = []
    for i, sample in enumerate(calibration):
        call = as_call(sample)
        try:
            signature.bind(*call[0], **call[1])
        except TypeError as error:
            raise TypeError(
                f"calibration sample {i} {_describe(*call)} does not fit {where}: {error}. "
                "Each sample is a tuple of positional arguments or a dict of keyword "
                "arguments, as the example inputs are"
            ) from None
        if _structure(*call) != expected:
            raise TypeError(
                f"calibration sample {i} is {_describe(*call)}, but the model is exported "
                f"with {_describe(args, kwargs)} for {where}: every sample must have the "
                "example inputs' structure (the same arguments, tensors where they have "
                "tensors), since calibration picks nodes of that one graph"
            )
        _check_shapes(i, call, (args, kwargs), signature, ranges)
        samples.append(call)
    if not samples:
        raise ValueError("calibration is empty: pass at least one sample input, or None")
    return samples


def _dynamic_ranges(
    model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any
) -> dict[int, dict[int, tuple[float, float]]]:
    """``{leaf index of (args, kwargs): {dim: (min, max)}}``: the sizes ``dynamic_shapes``
    lets vary. Read with torch.export's own parser of ``dynamic_shapes`` (private: torch
    has no public one), so that every form it takes means what it means there."""
    if dynamic_shapes is None:
        return {}
    from torch.export import dynamic_shapes as shapes

    combined = shapes._combine_args(model, args, kwargs)
    leaf_of = {id(v): j for j, v in enumerate(pytree.tree_leaves((args, kwargs)))}
    ranges: dict[int, dict[int, tuple[float, float]]] = {}
    for constraint in shapes._process_dynamic_shapes(combined, dynamic_shapes):
        bounds = getattr(constraint, "constraint_range", None)  # None: Dim.AUTO, any size
        low, high = (0, math.inf) if bounds is None else (bounds.vr.lower, bounds.vr.upper)
        low, high = float(low), float(high)  # sympy's bounds; int_oo is inf
        ranges.setdefault(leaf_of[constraint.t_id], {})[constraint.dim] = (low, high)
    return ranges


def _check_shapes(
    index: int,
    call: tuple[tuple, dict],
    example: tuple[tuple, dict],
    signature: inspect.Signature,
    ranges: dict[int, dict[int, tuple[float, float]]],
) -> None:
    """A ValueError where sample ``index``'s tensors (of the example's structure) have a
    shape the program will not take: a size other than the example's where
    ``dynamic_shapes`` does not let it vary, or outside the range it gives."""
    positional = list(signature.parameters)
    mine = pytree.tree_leaves(call)
    for j, (path, theirs) in enumerate(pytree.tree_flatten_with_path(example)[0]):
        ours = mine[j]
        if not isinstance(theirs, torch.Tensor):
            continue
        free = ranges.get(j, {})
        same_rank = ours.dim() == theirs.dim()
        bad = [
            d
            for d in range(ours.dim())
            if same_rank
            and not (
                free[d][0] <= ours.shape[d] <= free[d][1]
                if d in free
                else ours.shape[d] == theirs.shape[d]
            )
        ]
        if same_rank and not bad:
            continue
        name = _input_name(path, positional)
        if not same_rank:
            fix = "give samples with as many dimensions as the example inputs"
        elif all(d not in free for d in bad):
            dims = ", ".join(f"{d}: Dim('{name.split('[')[0]}_{d}')" for d in bad)
            fix = (
                f"export with dynamic_shapes marking the sizes that vary (e.g. "
                f"dynamic_shapes={{'{name.split('[')[0]}': {{{dims}}}}}, Dim from "
                "torch.export), or give samples of the example's shapes"
            )
        else:
            spans = ", ".join(f"dim {d}: {_span(*free[d])}" for d in bad if d in free)
            fix = f"widen the Dim's min/max in dynamic_shapes ({spans}), or give samples within it"
        raise ValueError(
            f"calibration sample {index}: {name} has shape {list(ours.shape)}, but the program "
            f"is exported for {name} of shape {list(theirs.shape)} (the example inputs'"
            f"{', dynamic_shapes aside' if free else ''}) and would refuse it: {fix}"
        )


def _span(low: float, high: float) -> str:
    return f"{low:.0f}..{'' if math.isinf(high) else f'{high:.0f}'}"


def _input_name(path: tuple, positional: list[str]) -> str:
    """The forward's argument a leaf path of ``(args, kwargs)`` is in: ``x``, ``batch['ids']``."""
    where, key, *rest = path
    if where.idx == 0:  # args
        name = positional[key.idx] if key.idx < len(positional) else f"args[{key.idx}]"
    else:
        name = str(key.key)
    return name + pytree.keystr(tuple(rest))


def export(
    model: nn.Module,
    args: Any,
    kwargs: dict[str, Any] | None = None,
    *,
    policy: Policy | str | None = None,
    dtype: torch.dtype | None = None,
    dynamic_shapes: Any = None,
    calibration: Iterable[Any] | None = None,
    tol: float | None = None,
) -> ExportedProgram:
    """Export ``model`` for inference in mixed precision: a ``torch.export.ExportedProgram``.

    The program is the model in eval mode (dropout off, batch norm on its running
    statistics, whatever mode the model was in; its own flags are restored after), without
    autograd, computing each op at the dtype ``policy`` gives it, with every cast an aten op
    in the graph. Each parameter and buffer that only low-precision ops read is stored in
    the low dtype (``program.state_dict``), so the program's state is about half the
    float32 model's and casting weights costs nothing at run time.

    Args:
        model: the model (an ``nn.Module``); a module from :func:`amp_graph.compile`
            gives its model, policy and dtype.
        args / kwargs: example inputs, as for ``torch.export.export`` (a single tensor is
            taken as ``(tensor,)``).
        policy / dtype: as for :func:`amp_graph.compile` (default ``"O1"`` and the device's
            autocast dtype).
        dynamic_shapes: as ``torch.export.export`` takes it (``{"x": {0: Dim("batch")}}``).
        calibration: sample inputs (tuples of forward arguments, or dicts of keyword
            arguments, with the example inputs' structure). When given,
            :func:`amp_graph.autopolicy` runs on them and keeps in float32 the nodes whose
            low precision puts the outputs further than ``tol`` from float32 (or
            non-finite); :func:`export_info` says which and why.
        tol: calibration's tolerance (default: autopolicy's, 10 x the dtype's epsilon).

    Returns:
        The ExportedProgram: ``program.module()(*args)`` equals
        ``amp_graph.compile(model.eval(), policy, dtype)(*args)`` under ``torch.no_grad()``,
        bit for bit. Save it with ``torch.export.save`` (or :func:`amp_graph.deploy.save`,
        which also keeps the :class:`ExportInfo`); compile it with AOTInductor, or export it
        to ONNX (:mod:`amp_graph.deploy.targets`).

    Raises:
        TypeError: bad model, inputs or calibration samples (naming the signature).
        ValueError / NotImplementedError: a policy or dtype that cannot be exported.
        CaptureError: the model could not be captured.
    """
    in_place = None if isinstance(model, CompiledModule) else compiled_in_place(model)
    compiled = model if isinstance(model, CompiledModule) else in_place
    if compiled is not None:
        policy = compiled.policy if policy is None else policy
        dtype = compiled.dtype if dtype is None else dtype
        model = compiled.model
    if not isinstance(model, nn.Module):
        raise TypeError(f"amp_graph.export takes an nn.Module; got {type(model).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs is a dict of keyword arguments; got {type(kwargs).__name__}")
    args, kwargs = as_call(args)[0], dict(kwargs or {})
    policy = "O1" if policy is None else policy
    request = admit(policy, dtype, model, (args, kwargs), runs_here=False)
    base, dtype = request.policy, request.dtype
    if base.fp8 is not None:
        raise NotImplementedError(
            f"amp_graph.export does not export the fp8 policy {base.name!r} yet: its float8 "
            "linears are amp_graph ops that torch.export.load, AOTInductor and ONNX do not "
            "know. Export with policy='O1'/'O2' and dtype=torch.bfloat16 or torch.float16"
        )
    seconds: dict[str, float] = {}
    # a model compile_ compiled in place is captured through its class's forward
    own_forward = class_forward(model) if in_place is not None else contextlib.nullcontext()
    with eval_mode(model), torch.no_grad(), own_forward, gc_paused():
        demoted: dict[str, str] = {}
        table_name = base.name  # "O2", also after calibration adds its overrides
        if calibration is not None:
            samples = calibration_samples(model, calibration, args, kwargs, dynamic_shapes)
            start = time.perf_counter()
            calibrated = autopolicy(
                model,
                base,
                dtype,
                sample_inputs=[s[1] or s[0] for s in samples],
                tol=tol,
                backward=False,
                dynamic_shapes=dynamic_shapes,  # the export's capture: the same node names
            )
            seconds["calibration"] = time.perf_counter() - start
            demoted = {n: calibrated.notes.get(n, "") for n in calibrated.nodes}
            demoted = {n: d for n, d in demoted.items() if n not in base.nodes}
            base = calibrated
        # no backward: nothing to recast in it. Named as the preset, whose tables the
        # islands quote ("in O2's deny table")
        inference = dataclasses.replace(base, recompute_casts=False, name=table_name)
        captured = capture_and_rewrite(
            model,
            args,
            kwargs,
            AmpRequest(inference, dtype, request.device_type),
            keep_original=False,  # nothing diffs an export against its capture
            dynamic_shapes=dynamic_shapes,
            code_on_call=True,  # the graph is lifted, never called
            # an inference program has no backward to keep: a Function's forward ops are
            # the program's, each under the policy (and ONNX/AOTI can lower them)
            keep_functions=False,
        )
        gm = captured.graph_module
        if not inference.casts_nothing:
            refuse_autocast_dependent_ops(gm, request.device_type, dtype)
        record = gm.meta[COMPILE_META]
        seconds["capture"] = record.seconds["capture"]
        seconds["passes"] = sum(record.seconds.values()) - record.seconds.get("capture", 0.0)
        start = time.perf_counter()
        islands = _islands(gm, inference)  # the record's, read before the casts become aten's
        seconds["lift"] = time.perf_counter() - start
        start = time.perf_counter()
        aten_casts(gm)  # the export's own passes
        casts_before_views(gm)
        stored = state_casts(gm)
        seconds["passes"] += time.perf_counter() - start
        start = time.perf_counter()
        program = exported_program(gm, stored.dtypes, _example(args, kwargs))
        seconds["lift"] += time.perf_counter() - start
    prefix = f"{gm.meta.get(MODEL_ROOT, '')}."
    info = ExportInfo(
        base,
        dtype,
        demoted,
        {t.removeprefix(prefix): d for t, d in stored.dtypes.items()},
        islands,
        _count_casts(program),
        seconds,
    )
    program.graph_module.meta[INFO] = info
    if calibration is not None:
        info.calibration_error = _check_calibrated(program, model, samples, dtype, tol, info)
    return program


def sample_errors(
    run: Callable[..., Any], model: nn.Module, calls: Iterable[tuple[tuple, dict]]
) -> list[OutputError]:
    """:func:`output_error` of ``run`` against ``model`` in float32 (eval mode, no
    autograd), per call ``(args, kwargs)``."""
    with eval_mode(model), torch.no_grad():
        return [output_error(run(*a, **k), model(*a, **k)) for a, k in calls]


def _check_calibrated(
    program: ExportedProgram,
    model: nn.Module,
    samples: list[tuple[tuple, dict]],
    dtype: torch.dtype,
    tol: float | None,
    info: ExportInfo,
) -> OutputError:
    """The program itself, run on the calibration samples against the float32 model: what
    calibration promises is checked on what is shipped, not only on autopolicy's graphs."""
    tol = default_tol(dtype) if tol is None else float(tol)
    run, errors = program.module(), []
    for i, call in enumerate(samples):
        try:
            errors += sample_errors(run, model, [call])
        except AssertionError as error:  # a guard of the program (calibration_samples
            if not str(error).startswith("Guard failed"):  # checked the shapes it knows)
                raise
            raise ValueError(
                f"calibration sample {i} {_describe(*call)} is refused by the exported "
                f"program ({error}): the model's code fixes that size; give samples the "
                "program takes"
            ) from None
    for i, error in enumerate(errors):
        if not error.rel_l2 <= tol:
            raise AutopolicyError(
                f"the calibrated program misses tol={tol:g} on calibration sample {i}: "
                f"relative error {error.rel_l2:.3g} against float32 (max |error| "
                f"{error.max_abs:.3g}), with {len(info.demoted)} nodes in float32 "
                f"({', '.join(info.demoted) or 'none'}). Raise tol, start from a policy with "
                "more float32 (e.g. 'O1'), or keep the modules involved in float32 with "
                "policy overrides",
                info.policy,
            )
    return OutputError.worst(errors)


def _example(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    def detached(value: Any) -> Any:
        return value.detach() if isinstance(value, torch.Tensor) else value

    return pytree.tree_map(detached, (args, kwargs))


def _islands(gm: torch.fx.GraphModule, policy: Policy) -> list[Island]:
    """Every op the graph computes in float32 (views aside: they compute nothing), and why:
    the policy's table or override, calibration's evidence, a kernel this CPU lacks, or,
    for ops that follow or promote their inputs, float32 inputs."""
    found = []
    for node in gm.graph.nodes:
        amp = node.meta.get(AMP)
        if amp is None or amp.role is not Role.OP or amp.source == "fixed":
            continue
        if amp.out_dtype != torch.float32 and amp.compute_dtype != torch.float32:
            continue
        why = policy.notes.get(node.name) or amp.detail or amp.source
        if amp.rule in (Rule.FOLLOW, Rule.PROMOTE) and node.name not in policy.notes:
            floating = any(_floating(n.meta.get(VAL)) for n in node.all_input_nodes)
            why += "; its inputs are float32" if floating else "; made in float32 (no input)"
        found.append(Island(node.name, amp.op, amp.module_path, why))
    return found


# what a program's casts are: amp_graph's (aten_casts) and the model's own ``x.to(dtype)``
CAST_OPS = (
    torch.ops.aten._to_copy.default,
    torch.ops.aten.to.dtype,
    torch.ops.aten.to.dtype_layout,
    torch.ops.prims.convert_element_type.default,
)


def _floating(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype.is_floating_point


def _count_casts(program: ExportedProgram) -> int:
    """The casts between floating dtypes (not the model's own ``mask.to(torch.bool)``)."""
    return sum(
        n.op == "call_function"
        and n.target in CAST_OPS
        and _floating(n.meta.get(VAL))
        and isinstance(n.args[0], torch.fx.Node)
        and _floating(n.args[0].meta.get(VAL))
        for n in program.graph.nodes
    )
