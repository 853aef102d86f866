"""Find the few nodes that need float32, from data: :func:`autopolicy`.

The search runs the compiled model and its float32 shadow (:mod:`amp_graph.accuracy.shadow`) on
each sample input, and while a sample fails (an inf/nan where float32 is finite, outputs
or gradients further than ``tol`` from float32) demotes the node that the measurements
blame to float32, with a node override whose note records the evidence. When every sample
passes it tries to give each demotion back, keeping only those still needed.

Blame, in order:

1. the first node, in graph order, with a non-finite value where float32 is finite;
2. the first fp8 quantization that flushes more than ``flush_tol`` of its input's nonzero
   values to zero (:attr:`NumericsRow.flushed`), whatever the output error: one large value
   sets a tensorwise scale (``448 / amax``) so low that the rest underflow, and it also
   dominates the relative L2 error, which then hides the loss; its fp8 linears are demoted;
3. with finite values but outputs too far from float32: the op whose relative error grows
   most over its inputs' (its own rounding, not inherited error) when it runs in the low
   dtype; when it already runs in float32 it amplifies its inputs' rounding (a softmax of
   scores too large for the low dtype's precision), and the nearest low-precision ops
   upstream are blamed;
4. with the graph within ``tol`` of its float32 shadow but not of the float32 model itself
   (checked where the model's forward is deterministic): the graph holds constants the
   model's Python derived from a low dtype while it was captured (a
   ``torch.finfo(x.dtype).min`` mask, ``.to(x.dtype)``), which the shadow shares. The
   low-precision ops whose dtype the Python read (:data:`passes.meta.DTYPE_READ`) are
   blamed: captured with them in float32, the model builds those constants in float32;
5. with ``backward``: the first node, in backward order, whose output gradient is
   non-finite, else the one nearest the loss whose gradient underflows (zero or subnormal
   in the low dtype at the loss scale, nonzero in float32), else the largest growth of
   gradient error.

A blamed cast inserted by amp_graph stands for its consumers: the value is out of the low
dtype's range there, so the ops reading it are demoted. A blamed view or getitem (whose
dtype is its input's: no override changes it) stands for the nearest low-precision ops
upstream.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from amp_graph.accuracy.float32_error import output_error
from amp_graph.accuracy.shadow import (
    NumericsRow,
    ShadowResult,
    scale_text,
    shadow_run,
    tensors_kept,
)
from amp_graph.capture import Captured, capture_for_policy
from amp_graph.frontends.compiler import CompiledModule, compiled_in_place
from amp_graph.frontends.front_door import admit
from amp_graph.frontends.model_forwards import class_forward
from amp_graph.passes.graph_copy import copy_graph_module
from amp_graph.passes.meta import DTYPE_READ
from amp_graph.policy import Policy

UNDERFLOW_BLAME = 0.01  # a gradient with more than this fraction underflowing is blamed
# autopolicy's default flush_tol: an fp8 quantization flushing more of its input's nonzero
# values to zero is a failure. Measured in float8_e4m3fn with tensorwise scales, ordinary
# activations flush far less: at most 0.015% of any linear's input in small random Llama and
# GPT-2 configs, 0.002% of gelu(linear(randn)) and layer norm outputs (width 256 and 1024),
# 0.9% of a SwiGLU product silu(a) * b (many values near zero). One outlier k times the
# others' scale (randn) flushes 1.7% at k = 1e4, 17% at 1e5 and 97% at 1e6.
FLUSH_TOL = 0.1
# the fp8 pass's nodes that make an fp8 linear's operands: demoting the linear undoes them
_FP8_OPERANDS = ("fp8 quantize", "fp8 scale")


class AutopolicyError(RuntimeError):
    """The search could not meet ``tol``; ``.policy`` holds the demotions it made."""

    def __init__(self, message: str, policy: Policy) -> None:
        super().__init__(message)
        self.policy = policy


@dataclass(frozen=True)
class Finding:
    """Why a sample fails, and the nodes to demote for it."""

    nodes: tuple[str, ...]
    reason: str


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _Blame:
    """Maps measured rows to the nodes a policy can demote."""

    def __init__(self, result: ShadowResult) -> None:
        self.rows = {r.node: r for r in result.nodes}
        self.low = result.dtype

    def runs_low(self, row: NumericsRow) -> bool:
        """An op computing in the low dtype whose dtype an override decides (a view or a
        getitem of a low value is neither: its producer is)."""
        return row.role == "op" and row.decided and row.forward.dtype == self.low

    def demotable(self, row: NumericsRow) -> tuple[str, ...]:
        """The node overrides to demote, by the names overrides use (an fp8 linear's is the
        captured linear's): the node itself when it is a low-precision op; a cast's, or an
        fp8 quantization's or scale's, low-precision consumers; otherwise the nearest
        low-precision ops upstream."""
        return tuple(dict.fromkeys(self.rows[n].override or n for n in self._demotable(row)))

    def _demotable(self, row: NumericsRow) -> tuple[str, ...]:
        if self.runs_low(row):
            return (row.node,)
        if row.role == "cast" or row.op in _FP8_OPERANDS:
            users = tuple(u for u in row.users if u in self.rows and self.runs_low(self.rows[u]))
            if users:
                return users
        seen: set[str] = set()
        frontier = list(row.inputs)
        found: list[str] = []
        while frontier:
            name = frontier.pop()
            if name in seen or name not in self.rows:
                continue
            seen.add(name)
            upstream = self.rows[name]
            if self.runs_low(upstream):
                found.append(name)
            else:
                frontier.extend(upstream.inputs)
        return tuple(found)


def _flush_finding(result: ShadowResult, sample: int, flush_tol: float) -> Finding | None:
    """The first fp8 quantization, in graph order, that flushes more than ``flush_tol`` of
    its input's nonzero values to zero, blamed on the linears it feeds; None if none does."""
    row = next((r for r in result.nodes if (r.flushed or 0.0) > flush_tol), None)
    if row is None or row.flushed is None:
        return None
    blame = _Blame(result)
    source = row.inputs[0] if row.inputs else row.node  # (x, scale): x
    peak = blame.rows[source].forward.max_abs if source in blame.rows else row.forward.max_abs
    linears = blame.demotable(row)
    needs = f", so {' and '.join(repr(n) for n in linears)} needs float32" if linears else ""
    reason = (
        f"fp8 underflow on sample {sample}: the {_name(row.forward.dtype)} quantization of "
        f"'{source}' flushes {100 * row.flushed:.1f}% of its nonzero values to zero (flush_tol "
        f"{100 * flush_tol:g}%): one outlier (max |x| {peak:.3g}) sets the scale{needs}"
    )
    return Finding(linears, reason)


def _forward_finding(
    result: ShadowResult, sample: int, tol: float, flush_tol: float = FLUSH_TOL
) -> Finding | None:
    blame = _Blame(result)
    low = _name(result.dtype)
    first = next((r for r in result.nodes if r.forward.new_nonfinite), None)
    if first is not None:
        limit = torch.finfo(result.dtype).max
        if first.forward.shadow_max_abs > limit:
            what = "its input" if first.role == "cast" else "max |x|"
            reason = (
                f"{what} {first.forward.shadow_max_abs:.2g} > {low} max {limit:.6g} "
                f"on sample {sample}"
            )
        else:
            reason = (
                f"{first.forward.new_nonfinite} inf/nan values where float32 is finite "
                f"(at '{first.node}') on sample {sample}"
            )
        return Finding(blame.demotable(first), reason)
    flushed = _flush_finding(result, sample, flush_tol)
    if flushed is not None:  # before the output error, which the outlier dominates
        return flushed
    output_error = max((o.rel_error for o in result.outputs), default=0.0)
    if output_error <= tol:
        return None
    best, growth = None, -math.inf
    for row in result.nodes:
        # float32 ops too: one that amplifies its inputs' rounding (softmax of huge scores)
        # cannot be demoted, but the low-precision ops feeding it can
        if row.role != "op" or not row.decided:
            continue
        inherited = max(
            (blame.rows[a].forward.rel_error for a in row.inputs if a in blame.rows), default=0.0
        )
        if row.forward.rel_error - inherited > growth:
            best, growth = row, row.forward.rel_error - inherited
    if best is None:
        return Finding((), f"output error {output_error:.2g} > tol {tol:.2g}")
    measured = (
        f"relative error {best.forward.rel_error:.2g} against float32, {growth:.2g} more than "
        f"its inputs'; output error {output_error:.2g} > tol {tol:.2g} on sample {sample}"
    )
    if blame.runs_low(best):
        return Finding(blame.demotable(best), measured)
    return Finding(
        blame.demotable(best),
        f"'{best.node}' ({best.op}, {_name(best.forward.dtype)}) amplifies the rounding of "
        f"its low-precision inputs: {measured}",
    )


def _model_finding(result: ShadowResult, reference: Any, sample: int, tol: float) -> Finding | None:
    """The graph's outputs against the float32 model's (``reference``), where its float32
    shadow found them close: blame the low-precision values whose dtype the model's Python
    read while captured."""
    error = output_error(result.output, reference)
    if error.rel_l2 <= tol:
        return None
    blame = _Blame(result)
    read = [n.name for n in result.graph_module.graph.nodes if n.meta.get(DTYPE_READ)]
    nodes: dict[str, None] = {}
    for name in read:
        if name in blame.rows:
            nodes.update(dict.fromkeys(blame.demotable(blame.rows[name])))
    return Finding(
        tuple(nodes),
        f"output error {error.rel_l2:.2g} against the float32 model > tol {tol:.2g} on sample "
        f"{sample}, though the graph is within tol of its float32 shadow: the model's Python "
        f"read the low dtype of {', '.join(read) or 'no captured value'} and built values "
        "from it (a torch.finfo(dtype).min mask, a .to(dtype)) that the graph holds as "
        "constants",
    )


def _backward_finding(result: ShadowResult, sample: int, tol: float) -> Finding | None:
    blame = _Blame(result)
    low = _name(result.dtype)
    scale = scale_text(result.scale or 1.0)
    bad_params = [p for p in result.params if p.grad.new_nonfinite or p.grad.rel_error > tol]
    if not bad_params:
        return None
    with_grads = [r for r in result.nodes if r.grad is not None]
    overflow = [r for r in with_grads if r.grad.new_nonfinite]  # type: ignore[union-attr]
    if overflow:
        row = overflow[-1]
        return Finding(
            blame.demotable(row),
            f"gradient overflow: {row.grad.new_nonfinite} inf/nan in its output gradient "  # type: ignore[union-attr]
            f"at loss scale {scale} on sample {sample}",
        )
    underflow = [r for r in with_grads if r.grad.underflow > UNDERFLOW_BLAME]  # type: ignore[union-attr]
    if underflow:
        row = underflow[-1]
        return Finding(
            blame.demotable(row),
            f"gradient underflow: {100 * row.grad.underflow:.0f}% of its output gradient is "  # type: ignore[union-attr]
            f"zero or subnormal in {low} at loss scale {scale} (nonzero in float32) on "
            f"sample {sample}",
        )
    best, growth = None, -math.inf
    for row in with_grads:
        if not blame.runs_low(row):
            continue
        downstream = max(
            (
                blame.rows[u].grad.rel_error  # type: ignore[union-attr]
                for u in row.users
                if u in blame.rows and blame.rows[u].grad is not None
            ),
            default=0.0,
        )
        if row.grad.rel_error - downstream > growth:  # type: ignore[union-attr]
            best, growth = row, row.grad.rel_error - downstream  # type: ignore[union-attr]
    worst = max(bad_params, key=lambda p: p.grad.rel_error)
    reason = (
        f"gradient error of '{worst.name}' {worst.grad.rel_error:.2g} > tol {tol:.2g} "
        f"on sample {sample}"
    )
    return Finding(blame.demotable(best) if best is not None else (), reason)


AUTO = "auto"  # autopolicy's dynamic_shapes default: capture as compile does


class _SharedCaptures(CompiledModule):
    """A CompiledModule whose captures come from a store the search shares: the model is
    captured once per input signature and set of node overrides, and each trial rewrites
    its own copy. The overrides are part of the key because the capture plans, from the
    policy, the dtypes the model's Python sees (:mod:`amp_graph.capture.planned_dtypes`): a
    demotion can change what is captured (GPT-2's ``.type(value.dtype)`` records float32
    where ``value`` is demoted), so a set of demotions is judged on the graph that
    :func:`amp_graph.compile` with that policy captures, whatever was tried before it.

    ``dynamic_shapes``: :data:`AUTO` captures as compile does (the first sizes static, then
    symbolic); None captures every sample with static sizes; a ``torch.export`` spec
    captures every sample with it. Node names depend on the capture (symbolic sizes add
    nodes), so a search whose demotions serve another capture must capture as it does."""

    def __init__(
        self,
        model: nn.Module,
        policy: Policy,
        dtype: torch.dtype,
        device_type: str,
        store: dict,
        dynamic_shapes: Any = AUTO,
    ) -> None:
        super().__init__(model, policy, dtype, device_type)
        self._store, self._dynamic_shapes = store, dynamic_shapes

    def _capture_graph(self, args: tuple, kwargs: dict, dynamic: bool) -> Captured:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        shapes = self._dynamic_shapes
        key = (
            spec,
            tuple(
                (tuple(v.shape), v.dtype, v.device) if isinstance(v, torch.Tensor) else repr(v)
                for v in leaves
            ),
            dynamic if isinstance(shapes, str) else None,
            self.policy.casts_nothing,
            frozenset(self.policy.nodes.items()),
        )
        if key not in self._store:
            self._store[key] = (
                super()._capture_graph(args, kwargs, dynamic)
                if isinstance(shapes, str)
                else capture_for_policy(
                    self.model,
                    args,
                    kwargs,
                    self.policy,
                    self.dtype,
                    device_type=self.device_type,
                    dynamic_shapes=shapes,
                )
            )
        base = self._store[key]
        return replace(base, graph_module=copy_graph_module(base.graph_module))


def _finite(tree: Any) -> bool:
    """Every floating tensor finite: a float32 output with inf or nan (a masked logit) is no
    reference for a relative error."""
    return all(
        bool(torch.isfinite(v).all())
        for v in pytree.tree_leaves(tree)
        if isinstance(v, torch.Tensor) and v.is_floating_point()
    )


def _same_bits(a: Any, b: Any) -> bool:
    """The same tensors, bit for bit (NaN where NaN), in the same structure."""
    left = [v for v in pytree.tree_leaves(a) if isinstance(v, torch.Tensor)]
    right = [v for v in pytree.tree_leaves(b) if isinstance(v, torch.Tensor)]
    return len(left) == len(right) and all(
        x.shape == y.shape and x.dtype == y.dtype and torch.equal(x.nan_to_num(), y.nan_to_num())
        for x, y in zip(left, right, strict=True)
    )


def as_call(sample: Any) -> tuple[tuple, dict]:
    """A sample's (args, kwargs): a dict is keyword arguments, a tuple or list positional
    ones, anything else the one positional argument."""
    if isinstance(sample, dict):
        return (), dict(sample)
    return (tuple(sample) if isinstance(sample, (tuple, list)) else (sample,)), {}


def default_tol(dtype: torch.dtype) -> float:
    """autopolicy's tolerance unless given: 10 x the dtype's epsilon (relative L2)."""
    return 10 * torch.finfo(dtype).eps


class _Search:
    def __init__(
        self,
        model: nn.Module,
        base: Policy,
        dtype: torch.dtype,
        device_type: str,
        samples: Sequence[tuple],
        tol: float,
        backward: bool,
        loss_fn: Callable[[Any], torch.Tensor] | None,
        scale: float | None,
        dynamic_shapes: Any,
        *,
        flush_tol: float = FLUSH_TOL,
    ) -> None:
        self.model, self.base, self.dtype = model, base, dtype
        self.samples, self.tol, self.flush_tol = samples, tol, flush_tol
        self.backward, self.loss_fn, self.scale = backward, loss_fn, scale
        self.device_type = device_type
        self.captures: dict = {}  # one capture per input signature and set of demotions
        self.dynamic_shapes = dynamic_shapes
        self._references: list[Any] | None = None

    def references(self) -> list[Any]:
        """Each sample's output from the float32 model itself (computed once, the model's
        buffers and the RNG state left as they were), or None where it is no reference: a
        forward that is not deterministic (dropout in training mode: two runs must give the
        same bits) or an output that is not finite. There the graph's float32 shadow stays
        the only reference."""
        if self._references is None:
            own = class_forward if compiled_in_place(self.model) else None
            devices = [
                t.device
                for s in self.samples
                for t in pytree.tree_leaves(s)
                if isinstance(t, torch.Tensor) and t.device.type == "cuda"
            ]
            self._references = []
            for args, kwargs in self.samples:
                with (
                    own(self.model) if own else contextlib.nullcontext(),
                    # batch norm in training mode updates its running statistics
                    tensors_kept(self.model.buffers()),
                    torch.random.fork_rng(devices=sorted(set(devices), key=str)),
                    torch.no_grad(),
                    torch.autocast(self.device_type, enabled=False),
                ):
                    first = self.model(*args, **kwargs)
                    second = self.model(*args, **kwargs)
                usable = _same_bits(first, second) and _finite(first)
                self._references.append(first if usable else None)
        return self._references

    def policy(self, demoted: dict[str, str]) -> Policy:
        if not demoted:
            return self.base
        policy = self.base.override(
            nodes=dict.fromkeys(demoted, "fp32"),
            notes={n: f"demoted by autopolicy: {why}" for n, why in demoted.items()},
        )
        return replace(policy, name=f"{self.base.name}+autopolicy")

    def failure(self, demoted: dict[str, str]) -> Finding | None:
        compiled = _SharedCaptures(
            self.model,
            self.policy(demoted),
            self.dtype,
            self.device_type,
            self.captures,
            self.dynamic_shapes,
        )
        for i, (args, kwargs) in enumerate(self.samples):
            result = shadow_run(
                compiled,
                args,
                kwargs,
                backward=self.backward,
                loss_fn=self.loss_fn,
                scale=self.scale,
            )
            finding = _forward_finding(result, i, self.tol, self.flush_tol)
            reference = self.references()[i]
            if finding is None and reference is not None:
                finding = _model_finding(result, reference, i, self.tol)
            if finding is None and self.backward:
                finding = _backward_finding(result, i, self.tol)
            if finding is not None:
                return finding
        return None


def autopolicy(
    model: nn.Module,
    policy: Policy | str = "O3",
    dtype: torch.dtype | None = torch.float16,
    *,
    sample_inputs: Sequence[Any],
    tol: float | None = None,
    flush_tol: float = FLUSH_TOL,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    backward: bool | None = None,
    scale: float | None = None,
    max_demotions: int = 32,
    give_back: bool = True,
    dynamic_shapes: Any = AUTO,
) -> Policy:
    """``policy`` plus float32 overrides for as few nodes as the samples show need them.

    Args:
        model: the model (an ``nn.Module``; a :class:`CompiledModule` gives its model).
        policy, dtype: where to start, as for :func:`amp_graph.compile`.
        sample_inputs: a list of forward arguments, each a tuple (``[(x,), (x2,)]``), a
            single tensor, or a dict of keyword arguments (``[{"input_ids": ids}]``).
        tol: the largest relative error (L2) of outputs (and, with ``backward``, of every
            parameter's gradient) against float32. Default: 10 x the dtype's epsilon
            (about 1e-2 for float16, 8e-2 for bfloat16).
        flush_tol: the largest fraction of an fp8 quantization's nonzero input values that
            may become zero (one outlier setting the scale flushes the rest); above it the
            linears it feeds are kept in float32, whatever ``tol`` says. Default
            :data:`FLUSH_TOL` (0.1; ordinary activations flush under 1%); 1 turns it off.
        loss_fn / backward / scale: check gradients too (``backward`` defaults to whether
            ``loss_fn`` is given); the loss is ``loss_fn(output)`` (or the scalar output)
            times ``scale`` (default 2**16 for float16, as GradScaler starts).
        max_demotions: stop and raise after this many.
        give_back: after every sample passes, drop each demotion that is not needed.
        dynamic_shapes: how the samples are captured. Node names depend on it (symbolic
            sizes add nodes), and the policy's overrides name nodes: search with the capture
            the policy will serve. ``"auto"`` (the default) captures as
            :func:`amp_graph.compile` does; None with static sizes for every sample; a
            ``torch.export`` spec with that spec (as :func:`amp_graph.export` captures).

    Returns:
        A :class:`Policy`: ``policy`` itself when nothing needs float32, else ``policy``
        with node overrides to float32 whose ``notes`` say why; :func:`amp_graph.explain`
        on a demoted node quotes the evidence.

    Raises:
        AutopolicyError: ``tol`` could not be met (``.policy`` has the demotions so far).
    """
    if isinstance(model, CompiledModule):
        model = model.model
    if not isinstance(model, nn.Module):
        raise TypeError(f"autopolicy takes the model (an nn.Module); got {type(model).__name__}")
    if isinstance(sample_inputs, torch.Tensor) or not len(sample_inputs):
        raise ValueError(
            "sample_inputs is a non-empty list of forward arguments, e.g. [(x,), (x2,)]"
        )
    samples = [as_call(s) for s in sample_inputs]
    request = admit(policy, dtype, model, samples[0])
    base, dtype, device_type = request.policy, request.dtype, request.device_type
    tol = default_tol(dtype) if tol is None else float(tol)
    flush_tol = float(flush_tol)
    if not 0.0 <= flush_tol <= 1.0:
        raise ValueError(f"flush_tol is a fraction of values, from 0 to 1; got {flush_tol}")
    backward = loss_fn is not None if backward is None else backward
    search = _Search(
        model,
        base,
        dtype,
        device_type,
        samples,
        tol,
        backward,
        loss_fn,
        scale,
        dynamic_shapes,
        flush_tol=flush_tol,
    )
    demoted: dict[str, str] = {}
    while (finding := search.failure(demoted)) is not None:
        new = [n for n in finding.nodes if n not in demoted]
        if not new or len(demoted) + len(new) > max_demotions:
            raise AutopolicyError(
                f"autopolicy could not meet tol={tol:g} after demoting {len(demoted)} nodes "
                f"({', '.join(demoted) or 'none'}): {finding.reason}"
                + ("" if new else "; no node left to demote for it")
                + ". Raise tol (or flush_tol), pass a smaller scale, or start from a policy "
                "with more float32 (e.g. 'O1'); the exception's .policy holds the demotions so far",
                search.policy(demoted),
            )
        for node in new:
            demoted[node] = finding.reason
    if give_back:
        for node in reversed(list(demoted)):
            trial = {n: why for n, why in demoted.items() if n != node}
            if search.failure(trial) is None:
                demoted = trial
    return search.policy(demoted)
