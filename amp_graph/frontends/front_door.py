"""The front door: the one sequence every entry point runs, from the user's request to a
rewritten graph.

``amp_graph.compile`` and ``compile_``, the ``torch.compile`` backend, ``amp_graph.Graph``,
``amp_graph.export`` and ``amp_graph.autopolicy`` all run, in this order:

1. :func:`admit`: the request (policy, low dtype, model) checked
   (:func:`~amp_graph.frontends.policy_request.check_request`), resolved on the device the
   model and its inputs are on (:func:`~amp_graph.frontends.policy_request.resolve`), the
   CPU's slow-product warning given (:mod:`amp_graph.frontends.cpu_low_speed`), and the
   policy's module overrides matched against the module the entry point captures;
2. a capture: of an ``nn.Module`` with :func:`amp_graph.capture.capture_for_policy`
   (:func:`capture_and_rewrite` runs it), or of dynamo's graph (the backend);
3. :func:`rewrite`: node overrides matched against the captured graph, the AMP passes
   (:func:`amp_graph.passes.run_passes`), their :class:`CompileRecord` on
   ``gm.meta["amp_graph"]``, and the recompute hooks where the graph runs as it is.

What differs between entry points is an argument, said once, never a step undone later:
where module paths start (``where``), whether they can be checked at all (the backend sees
a model only graph by graph), whether node overrides must match this one graph, whether the
graph runs as it is (``recompute_hooks``: False where AOTAutograd compiles it and its
partitioner decides what backward keeps), whether a copy from before the passes is kept.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from amp_graph.capture import Captured, capture_for_policy, gc_paused
from amp_graph.frontends.cpu_low_speed import warn_if_low_matmul_is_slow
from amp_graph.frontends.policy_request import (
    AmpRequest,
    check_module_type_overrides,
    check_request,
    device_type_of,
    resolve,
    validate_module_overrides,
    validate_node_overrides,
    warn_node_overrides_without_effect,
    warn_unmatched_op_overrides,
)
from amp_graph.ops import recompute_ops
from amp_graph.ops.recompute_cost import RecomputeCost, measured_cost
from amp_graph.passes import inline_regions, run_passes
from amp_graph.passes.graph_copy import copy_graph, graph_module_over
from amp_graph.passes.meta import COMPILE_META
from amp_graph.policy import Policy

log = logging.getLogger(__name__)


@dataclass
class CompileRecord:
    """What the passes did to one graph, kept on ``graph_module.meta["amp_graph"]``."""

    policy: Policy
    dtype: torch.dtype
    device_type: str
    stats: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    exact: bool = False  # dtypes come from example values (FakeTensor propagation)
    # the captured graph before the passes, for diffs: a GraphModule, or (graph, root) that
    # becomes one when first asked for (generating its code costs as much as a pass)
    _original: Any = field(default=None, repr=False)
    # what recompute_casts="auto" weighed (None: not asked, or the graph is compiled)
    recompute_cost: RecomputeCost | None = None

    @property
    def original(self) -> fx.GraphModule | None:
        """The graph as captured, before the passes (a GraphModule sharing the model's state)."""
        if isinstance(self._original, tuple):
            graph, root = self._original
            self._original = graph_module_over(root, graph)
        return self._original


def admit(
    policy: Policy | str,
    dtype: torch.dtype | None,
    module: nn.Module | None,
    inputs: Any = (),
    *,
    where: str | None = "model",
    runs_here: bool = True,
) -> AmpRequest:
    """Step 1: the request an entry point serves, checked and resolved for ``module``.

    Guarantees, in this order: a bad policy or dtype raises (naming the nearest preset, or
    what to pass); the policy is resolved on the first non-CPU device among ``module`` 's
    tensors and ``inputs`` (else the CPU), with the CPU's missing low-precision kernels;
    a CPU plan whose products are slow here warns once per process and dtype (unless
    ``runs_here`` is False: an exported program runs elsewhere); a module
    override matching none of ``module`` 's ``named_modules()`` paths raises ``ValueError``
    naming the nearest path, the paths read from ``where`` (``"model"``, or ``"graph"`` for
    a ``Graph``'s); a module type override no module of ``module`` is an instance of warns
    (raises where it is another class object of the name of one of the model's).
    ``where=None`` skips those checks: the entry point cannot see the whole
    model (the backend, which dynamo hands one graph at a time, warns instead), or checked
    it before (a later call of a compiled model).
    """
    check_request(policy, dtype)
    request = resolve(policy, dtype, device_type_of(module, inputs))
    if runs_here:
        warn_if_low_matmul_is_slow(request.policy, request.dtype, request.device_type)
    if where is not None and module is not None:
        named = list(module.named_modules())
        validate_module_overrides(request.policy, [name for name, _ in named], where=where)
        check_module_type_overrides(request.policy, [m for _, m in named])
    return request


def drop_string_annotations(gm: fx.GraphModule) -> None:
    """Forget annotations that are strings (``from __future__ import annotations``): as
    globals of the generated code they make the GraphModule unpicklable."""
    for node in gm.graph.nodes:
        if isinstance(node.type, str):
            node.type = None


TIMED_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps")  # what recompute_cost can time
_said_untimed: set[str] = set()


def _recompute_cost_on(device_type: str) -> RecomputeCost | None:
    """The measured cost behind recompute_casts="auto", or None (every cast recomputed, as
    with True) on a device type it cannot time, said once at WARNING."""
    if device_type in TIMED_DEVICE_TYPES:
        return measured_cost(device_type)
    if device_type not in _said_untimed:
        _said_untimed.add(device_type)
        log.warning(
            "amp_graph: recompute_casts='auto' cannot time casts on %s; every cast is "
            "recomputed, as with recompute_casts=True. Set Policy(recompute_casts=True or "
            "False) to choose.",
            device_type,
        )
    return None


def rewrite(
    gm: fx.GraphModule,
    request: AmpRequest,
    *,
    check_nodes: bool = True,
    check_each_pass: bool = False,
    seconds: dict[str, float] | None = None,
    keep_original: bool = True,
    recompute_hooks: bool = True,
    low_copies: Collection[torch.Tensor] = (),
    cuda_graphs: bool = False,
) -> CompileRecord:
    """Step 3: run the AMP passes on a captured ``gm`` in place and record what they did.

    ``gm``'s placeholders should carry example values (``meta["val"]``) so that every dtype
    is exact. ``check_nodes``: a node override naming no node of ``gm`` raises
    ``ValueError`` (False where ``gm`` is one piece of a model: the backend's); an op
    override matching none of its ops, and a node override on a node that reads nothing a
    policy casts (integers, float64), warn that they change nothing.
    ``check_each_pass``: verify after every pass (:func:`amp_graph.passes.run_passes`).
    ``seconds`` adds the capture's own timings to the record; ``keep_original=False`` keeps
    no copy of the graph before the passes (``record.original`` None: an export, which no
    diff reads). ``recompute_hooks``: the graph runs as it is, its recomputed casts through
    :mod:`amp_graph.ops.recompute_ops` 's saved-tensor hooks (installed on ``gm``), and
    ``recompute_casts="auto"`` weighs their cost measured on the device, as
    ``cast_gradients_per_consumer`` weighs a shared cast's reads against casts of their
    own. False: AOTAutograd compiles the graph: no hooks, ``"auto"`` leaves what backward
    keeps to its partitioner (``True`` still tags every cast it may for recompute), and
    shared casts are read. ``cuda_graphs``: the graph's calls are replayed as CUDA graphs,
    which pay a read's host time once, at capture: shared casts are read.
    ``low_copies``: the parameters the caller stores low as copies of float32 masters (O2 in
    a ``Graph``); the plan stores those it reads only in float32 in float32, and names them
    in ``gm.meta[WIDENED_PARAMETERS]`` (:mod:`amp_graph.passes.widen_parameters`): the
    caller stores them so before the graph runs.
    """
    policy = request.policy
    if check_nodes:
        validate_node_overrides(policy, [n.name for n in gm.graph.nodes])
    drop_string_annotations(gm)
    cost = None
    if recompute_hooks and policy.recompute_casts == "auto":
        cost = _recompute_cost_on(request.device_type)
    # where the graph runs as it is, the shared casts' consumers cast or read by the cost
    read_cost = None
    timed = request.device_type in TIMED_DEVICE_TYPES
    if recompute_hooks and policy.cast_gradients_per_consumer and timed and not cuda_graphs:
        read_cost = cost or measured_cost(request.device_type)
    # the collector off, as during the capture: a full collection walks every live object,
    # and a large graph's nodes make each pass's share of them grow with the graph
    with gc_paused():
        start = time.perf_counter()
        inlined = inline_regions(gm)  # the captured form the passes and diffs read: flat
        inlined_seconds = time.perf_counter() - start
        if check_nodes:  # the ops of the model's own autocast blocks are in the graph now
            warn_unmatched_op_overrides(policy, gm)
        original = (copy_graph(gm), gm) if keep_original else None
        result = run_passes(
            gm,
            policy,
            request.dtype,
            check_each_pass=check_each_pass,
            recompute_cost=cost,
            recompute_by_partitioner=not recompute_hooks,
            low_copies=low_copies,
            read_cost=read_cost,
        )
    if check_nodes:
        warn_node_overrides_without_effect(policy, gm)
    stats = {**inlined.stats, **result.stats}
    timings = {**(seconds or {}), "inline_regions": inlined_seconds, **result.seconds}
    exact = bool(result.stats.get("exact_dtypes"))
    record = CompileRecord(
        policy, request.dtype, request.device_type, stats, timings, exact, original, cost
    )
    gm.meta[COMPILE_META] = record
    if recompute_hooks and record.stats.get("casts_recomputed"):
        recompute_ops.install(gm)  # the hooks that keep those casts' sources instead
    return record


def capture_and_rewrite(
    module: nn.Module,
    args: tuple,
    kwargs: dict[str, Any],
    request: AmpRequest,
    *,
    keep_original: bool = True,
    recompute_hooks: bool = True,
    check_nodes: bool = True,
    check_each_pass: bool = False,
    low_copies: Collection[torch.Tensor] = (),
    cuda_graphs: bool = False,
    **capture_options: Any,
) -> Captured:
    """Steps 2 and 3 for an ``nn.Module``: capture ``module(*args, **kwargs)`` under the
    request's policy (``capture_options``: :func:`amp_graph.capture.capture_module` 's
    ``dynamic``, ``dynamic_shapes``, ``model_attr``, ``code_on_call``, ``keep_functions``),
    then :func:`rewrite` it, the capture's time in its record (``check_nodes`` and the rest:
    :func:`rewrite` 's)."""
    captured = capture_for_policy(
        module,
        args,
        kwargs,
        request.policy,
        request.dtype,
        device_type=request.device_type,
        **capture_options,
    )
    rewrite(
        captured.graph_module,
        request,
        check_nodes=check_nodes,
        check_each_pass=check_each_pass,
        seconds={"capture": captured.seconds},
        keep_original=keep_original,
        recompute_hooks=recompute_hooks,
        low_copies=low_copies,
        cuda_graphs=cuda_graphs,
    )
    return captured


__all__ = [
    "COMPILE_META",
    "TIMED_DEVICE_TYPES",
    "CompileRecord",
    "admit",
    "capture_and_rewrite",
    "drop_string_annotations",
    "rewrite",
]
