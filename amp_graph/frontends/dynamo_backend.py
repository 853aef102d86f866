"""``torch.compile(model, backend="amp_graph")``: the AMP passes on the graphs dynamo captures.

Dynamo captures a model as one or more FX graphs (it splits the model at graph breaks) and
hands each graph to a backend together with example inputs. For every graph, this backend:

1. attaches an example value to each placeholder (``meta["val"]``: dynamo's own fake
   tensor, else a fake of the example input), so every dtype is proven by FakeTensor
   propagation, exactly as ``amp_graph.compile(..., example_inputs=...)`` does;
2. runs every entry point's request and rewrite (:mod:`amp_graph.frontends.front_door`),
   the same passes as :func:`amp_graph.compile`, except that module and node overrides
   warn instead of raising (a graph is one piece of the model);
3. stores a :class:`~amp_graph.frontends.front_door.CompileRecord` on the graph
   (``gm.meta["amp_graph"]``), so :func:`amp_graph.report` and :func:`amp_graph.explain`
   work on it, and keeps the graph for :func:`captured_graphs`;
4. hands a copy of the rewritten graph to the inner backend (inductor by default), which
   compiles forward and, through AOTAutograd, backward.

Guarantees: the user's module is never modified (casts read parameters, gradients flow back
to them in their own dtype); each graph is rewritten on its own, from the dtypes its inputs
really have, so values that cross a graph break carry the dtype the next graph was traced
with; a pass failure raises (dynamo reports it) rather than running the graph unconverted;
an activation checkpoint stays one (recomputed in backward). What dynamo runs without
calling the backend (code between graphs, frames past ``recompile_limit``, frames whose
compile failed under ``suppress_errors``) runs as written, with autocast off: the backend
warns where it can see it coming (the compile that reaches the limit; its own failure
under ``suppress_errors``; torch's fused inference fast paths, which compute in float32).

Example::

    >>> import torch, amp_graph
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Softmax(-1))
    >>> compiled = torch.compile(model, backend=amp_graph.backend(inner="eager"))
    >>> compiled(torch.randn(2, 4)).dtype
    torch.float32
    >>> [gm] = amp_graph.captured_graphs(compiled)
    >>> amp_graph.report(gm).ops_by_dtype
    {'bf16': 1, 'fp32': 1}
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from amp_graph.capture import capture_graph
from amp_graph.capture.autocast_ops import (
    custom_ops_as_autocast_ops,
    library_ops_as_autocast_ops,
)
from amp_graph.capture.autograd_functions import AutocastState
from amp_graph.capture.dtensor_graphs import capture_dtensor_graph
from amp_graph.capture.op_bodies import check_mutating_ops
from amp_graph.frontends.compile_modes import check_inductor_mode
from amp_graph.frontends.dynamo_checkpoints import (
    checkpoints_as_dynamo_records_them,
    inline_checkpoints,
    mark_checkpoint_regions,
)
from amp_graph.frontends.dynamo_warnings import (
    SUPPRESSED_FAILURE,
    fast_path_modules,
    fast_path_warning,
    recompile_limit_warning,
)
from amp_graph.frontends.front_door import CompileRecord, admit, rewrite
from amp_graph.frontends.policy_request import AmpRequest, check_request
from amp_graph.frontends.traced_dtypes import (
    autocast_off,
    baked_dtype_nodes,
    baked_dtypes_warning,
    without_autocast,
)
from amp_graph.ops import recompute_ops
from amp_graph.ops.dtensors import is_dtensor
from amp_graph.passes import AMP, Role
from amp_graph.passes.classify import normalize_module_path
from amp_graph.passes.graph_copy import copy_graph_module
from amp_graph.passes.meta import VAL, short
from amp_graph.policy import Policy, nearest

log = logging.getLogger(__name__)
# how the backend's errors and warnings about one of the model's ops name the model
_OWNER = "the model (torch.compile backend)"

BACKEND_NAME = "amp_graph"
BUILTIN_INNERS = ("inductor", "eager", "aot_eager")
EXAMPLE_VALUE = "example_value"  # dynamo's key for a node's fake value

InnerBackend = Callable[[fx.GraphModule, list[Any]], Callable[..., Any]]


class AmpGraphBackend:
    """A dynamo backend: the AMP passes on each captured graph, then ``inner``.

    Make one with :func:`backend`. Pass it to ``torch.compile(model, backend=...)``; every
    graph it rewrites is kept, in compile order, in :attr:`graphs`.
    """

    def __init__(
        self,
        policy: Policy | str,
        dtype: torch.dtype | None,
        inner: str | InnerBackend,
        *,
        check_each_pass: bool = False,
    ) -> None:
        self.policy = policy
        self.dtype = dtype
        self.inner = inner
        self.check_each_pass = check_each_pass
        self._graphs: list[fx.GraphModule] = []
        self._seen_paths: set[str] = set()
        self._seen_nodes: set[str] = set()
        self._warned: set[str] = set()

    @property
    def graphs(self) -> list[fx.GraphModule]:
        """The rewritten graphs, in the order dynamo handed them over (a new list)."""
        return list(self._graphs)

    def __repr__(self) -> str:
        policy = self.policy if isinstance(self.policy, str) else self.policy.name
        dtype = "device default" if self.dtype is None else short(self.dtype)
        inner = (
            self.inner
            if isinstance(self.inner, str)
            else getattr(self.inner, "__name__", "callable")
        )
        return f"amp_graph.backend(policy={policy!r}, dtype={dtype}, inner={inner!r})"

    def __call__(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], **inner_kwargs: Any
    ) -> Callable:
        """Capture ``gm`` down to aten ops, rewrite it for mixed precision and return the inner
        backend's callable.

        ``inner_kwargs`` are ``mode=`` and ``options=`` from ``torch.compile``; they configure
        inductor (as config patches) and are refused for other inner backends.

        Warns (``UserWarning``) where dynamo is about to run code without this backend, in
        float32: when this compile reaches the frame's ``recompile_limit``
        (:func:`recompile_limit_warning`), and when it fails under
        ``torch._dynamo.config.suppress_errors`` (then re-raises).
        """
        try:
            compiled = self._compile(gm, example_inputs, inner_kwargs)
        except Exception:
            if torch._dynamo.config.suppress_errors:  # dynamo will run the frame as written
                warnings.warn(SUPPRESSED_FAILURE, stacklevel=2)
            raise
        message = recompile_limit_warning(_graph_owner(gm))
        if message is not None and message not in self._warned:  # DDP's pieces share a frame
            self._warned.add(message)
            warnings.warn(message, stacklevel=2)
        return compiled

    def _compile(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], inner_kwargs: dict[str, Any]
    ) -> Callable:
        start = time.perf_counter()
        # module paths: dynamo hands the model over graph by graph (_check_overrides warns)
        request = admit(self.policy, self.dtype, gm, example_inputs, where=None)
        policy, dtype, device_type = request.policy, request.dtype, request.device_type
        # Called under torch.autocast, dynamo traced the dtypes autocast gives: the retrace
        # runs as dynamo traced (ops recorded before autocast's casts); the policy alone
        # decides inside the graph, so autocast is off while it is rewritten, compiled, run.
        ambient = torch.is_autocast_enabled(device_type)
        if ambient:
            _check_ambient_dtype(device_type, policy, dtype)
        if any(is_dtensor(value) for value in example_inputs):  # tensor parallelism
            aten_gm = capture_dtensor_graph(gm, example_inputs, policy, dtype, device_type)
        else:
            autocast = AutocastState.of_policy(device_type, None if policy.casts_nothing else dtype)
            aten_gm = capture_graph(inline_checkpoints(gm), example_inputs, autocast)
            mark_checkpoint_regions(aten_gm)
        if not policy.casts_nothing and (fused := fast_path_modules(aten_gm)):
            warnings.warn(fast_path_warning(fused, dtype), stacklevel=2)
        with autocast_off(device_type):
            compiled = self._rewrite_and_compile(
                aten_gm, example_inputs, inner_kwargs, request, start
            )
        if not ambient and not policy.casts_nothing and (baked := baked_dtype_nodes(aten_gm)):
            self._warn_once(
                "baked dtypes",
                baked_dtypes_warning(_graph_owner(gm), baked, policy.name, dtype, device_type),
            )
        return without_autocast(compiled, device_type) if ambient else compiled

    def _rewrite_and_compile(
        self,
        aten_gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        inner_kwargs: dict[str, Any],
        request: AmpRequest,
        start: float,
    ) -> Callable:
        policy = request.policy
        missing = attach_example_values(aten_gm, example_inputs)
        record = rewrite(
            aten_gm,
            request,
            check_nodes=False,  # one graph of the model: _check_overrides warns
            check_each_pass=self.check_each_pass,
            seconds={"capture": time.perf_counter() - start},
            # only the eager inner backend runs the graph as it is (AOTAutograd's
            # partitioner decides what backward keeps for the others)
            recompute_hooks=self.inner == "eager",
        )
        record.exact = record.exact and not missing
        finished = time.perf_counter()
        sync_example_values(aten_gm)
        # the retrace ran without autocast: a custom op that writes into its inputs is
        # checked once the plan has given its inputs their dtypes
        state = AutocastState.of_policy(
            request.device_type, None if policy.casts_nothing else request.dtype
        )
        check_mutating_ops(aten_gm, state.entered, _OWNER)
        handed = copy_graph_module(aten_gm)  # inductor's pre-grad passes edit the graph they get
        if self.inner != "eager":
            # AOTAutograd would trace through a checkpoint call, and keep a custom op without
            # the autocast its body runs under
            checkpoints_as_dynamo_records_them(handed)
            custom_ops_as_autocast_ops(handed)
            library_ops_as_autocast_ops(handed, _OWNER)
        record.seconds["copy_for_inner"] = time.perf_counter() - finished
        self._graphs.append(aten_gm)
        self._check_overrides(policy, aten_gm)
        log.info("%s", _summary(aten_gm, record, len(self._graphs)))
        if callable(self.inner) and record.stats.get("casts_recomputed", 0):
            self._warn_once(
                "callable inner",
                f"amp_graph.backend: the graph marks {record.stats['casts_recomputed']} casts "
                "to recompute in the backward, and an inner backend given as a callable gets "
                "no recompute hooks: if it runs the graph as it is, those low-precision copies "
                "stay alive to the backward (recompute_casts saves nothing). Through "
                "AOTAutograd its partitioner decides instead, and this does not apply. Use "
                "inner='eager' (hooks) or 'aot_eager'/'inductor', wrap what your callable "
                "returns in amp_graph.ops.recompute_ops.recording, or set "
                "Policy(recompute_casts=False).",
            )
        return self._compile_inner(handed, example_inputs, inner_kwargs)

    def _compile_inner(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], kwargs: dict[str, Any]
    ) -> Callable:
        if self.inner == "inductor":
            from torch._inductor.compile_fx import compile_fx

            patches = _inductor_config_patches(**kwargs)
            if patches:
                return compile_fx(gm, list(example_inputs), config_patches=patches)
            return compile_fx(gm, list(example_inputs))
        if kwargs:
            raise TypeError(
                f"torch.compile's {sorted(kwargs)} configure inductor, but this amp_graph "
                f"backend hands its graphs to {self.inner!r}; drop them or use inner='inductor'"
            )
        if isinstance(self.inner, str):
            from torch._dynamo.backends.registry import lookup_backend

            compiled = lookup_backend(self.inner)(gm, list(example_inputs))
            # the graph runs as it is: keep recomputed casts' sources, as compile does (with
            # AOTAutograd, aot_eager and inductor, its partitioner decides what is kept)
            return recompute_ops.recording(compiled) if self.inner == "eager" else compiled
        return self.inner(gm, list(example_inputs))

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s", message)

    def _check_overrides(self, policy: Policy, gm: fx.GraphModule) -> None:
        """Warn once about module path / node overrides that match nothing captured so far.

        Dynamo may split a model over several graphs, so an override cannot be checked
        against the whole model (as ``amp_graph.compile`` does) when one graph arrives.
        """
        if not (policy.modules or policy.nodes):
            return
        for node in gm.graph.nodes:
            self._seen_nodes.add(node.name)
            for value in (node.meta.get("nn_module_stack") or {}).values():
                self._seen_paths.add(normalize_module_path(value[0]))
        try:
            policy.validate_for(self._seen_paths, self._seen_nodes)
        except ValueError as error:
            self._warn_once(
                str(error),
                f"{error} (checked against the {len(self._graphs)} graph(s) dynamo has "
                "captured so far; a later graph may still match)",
            )


def _check_ambient_dtype(device_type: str, policy: Policy, dtype: torch.dtype) -> None:
    """An ambient torch.autocast in another dtype than the policy's: dynamo traced that
    dtype's reads, which the graph would then mix with the policy's; raise, saying so."""
    ambient = torch.get_autocast_dtype(device_type)
    if not policy.casts_nothing and ambient != dtype:
        raise ValueError(
            f"the compiled model is called under torch.autocast({device_type!r}, "
            f"{short(ambient)}), but its amp_graph backend computes in {short(dtype)}: the "
            f"dtypes the model reads would be {short(ambient)}'s inside a {short(dtype)} plan. "
            f"Call it under torch.autocast({device_type!r}, torch.{str(dtype).split('.')[-1]}),"
            " or outside torch.autocast, or give the backend dtype="
            f"torch.{str(ambient).split('.')[-1]}."
        )


def _graph_owner(gm: fx.GraphModule) -> str:
    """The model a dynamo graph comes from, as its module stacks name it."""
    for node in gm.graph.nodes:
        for _, kind in (node.meta.get("nn_module_stack") or {}).values():
            name = getattr(kind, "__name__", None) or str(kind).rsplit(".", 1)[-1].strip("'>")
            return f"{name}'s code"
    return "the compiled code"


def backend(
    policy: Policy | str = "O1",
    dtype: torch.dtype | None = None,
    inner: str | InnerBackend = "inductor",
    *,
    check_each_pass: bool = False,
) -> AmpGraphBackend:
    """A configured ``torch.compile`` backend: the AMP passes, then ``inner``.

    Args:
        policy: a preset name (``"O0"``, ``"O1"``, ``"O2"``, ``"O3"``, ``"autocast"``) or an
            :class:`amp_graph.Policy`. ``"autocast"`` uses torch.autocast's lists for the
            device of each graph's inputs.
        dtype: ``torch.float16`` or ``torch.bfloat16``; by default torch.autocast's for the
            graph's device (float16 on CUDA, bfloat16 elsewhere).
        inner: what compiles the rewritten graphs: ``"inductor"``, ``"eager"``,
            ``"aot_eager"``, another registered dynamo backend name, or a backend callable
            ``(gm, example_inputs) -> callable``.
        check_each_pass: run the verifier after each dtype pass and lint the graph after
            the others (slower; for tests: :func:`amp_graph.passes.run_passes`).

    Returns:
        An :class:`AmpGraphBackend`; ``torch.compile(model, backend=amp_graph.backend())``.
        Its graphs: :func:`captured_graphs`.

    Raises:
        ValueError: an unknown preset, dtype or inner backend name (naming the nearest one);
            a policy with ``output_dtype`` but not ``cast_inputs`` (:func:`refuse_output_dtype`).
        TypeError: a policy, dtype or inner of the wrong type.
    """
    check_request(policy, dtype)
    refuse_output_dtype(policy)
    return AmpGraphBackend(policy, dtype, _check_inner(inner), check_each_pass=check_each_pass)


def refuse_output_dtype(policy: Policy | str) -> None:
    """The backend applies ``Policy.output_dtype`` only with ``cast_inputs`` (O2, O3): dynamo
    hands over the code between graph breaks as graphs of their own, whose outputs are
    intermediate values the next graph computes with. Where every graph casts its inputs to
    the low dtype at entry, a value cast up at one graph's exit is cast back at the next
    one's entry, exactly; without that, the next graph would compute its first ops on the
    float32 value, in other dtypes than the model's one graph would."""
    if isinstance(policy, Policy) and policy.output_dtype is not None and not policy.cast_inputs:
        raise ValueError(
            f"policy {policy.name!r} has output_dtype={policy.output_dtype} without "
            "cast_inputs, which the amp_graph backend does not apply: dynamo may split the "
            "compiled code into graphs whose outputs are intermediate values, not the "
            "model's, and the next graph would compute on them in float32. Cast in your "
            "code instead (loss_fn(out.float(), y)), compute the loss inside the compiled "
            "function, or use amp_graph.compile(model, policy, output_dtype=torch.float32)"
        )


def _check_inner(inner: Any) -> str | InnerBackend:
    if not isinstance(inner, str):
        if callable(inner):
            return inner
        raise TypeError(
            f"inner is a dynamo backend name such as 'inductor' or a backend callable; "
            f"got {inner!r} of type {type(inner).__name__}"
        )
    if inner == BACKEND_NAME:
        raise ValueError(
            "inner is the backend amp_graph hands its rewritten graphs to; "
            "'amp_graph' would run the passes twice. Use 'inductor' or 'eager'."
        )
    if inner in BUILTIN_INNERS:
        return inner
    from torch._dynamo import list_backends

    names = [n for n in list_backends(exclude_tags=()) if n != BACKEND_NAME]
    if inner not in names:
        raise ValueError(
            f"unknown inner backend {inner!r}; use one of {list(BUILTIN_INNERS)}, "
            f"a name in torch._dynamo.list_backends(), or a backend callable."
            f"{nearest(inner, [*BUILTIN_INNERS, *names])}"
        )
    return inner


def _inductor_config_patches(
    mode: str | None = None, options: dict[str, Any] | None = None, **unknown: Any
) -> dict[str, Any]:
    """``torch.compile(mode=..., options=...)`` as inductor config patches."""
    if unknown:
        raise TypeError(
            f"the amp_graph backend got unexpected arguments {sorted(unknown)} from "
            "torch.compile; it understands mode= and options="
        )
    patches: dict[str, Any] = {}
    check_inductor_mode(mode, "the amp_graph backend")
    if mode not in (None, "default"):
        from torch._inductor import list_mode_options

        patches.update(list_mode_options(mode))
    patches.update(options or {})
    return patches


def attach_example_values(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> int:
    """Give each placeholder ``meta["val"]``, the fake value it is compiled for; return how
    many are left without one.

    The example inputs are the truth: dynamo calls the backend with the values the graph
    will get. A fake example input is used as is (DDPOptimizer passes the fake outputs of
    the previous, already rewritten, piece; the placeholder's own ``example_value``, copied
    from the unsplit graph, predates the rewrite). For a real example input, the
    placeholder's ``example_value`` (or ``val``) is kept when it agrees on dtype, device and
    rank, since dynamo's carries symbolic sizes; otherwise the input is faked. All fakes
    come from one fake mode, so that propagation never mixes modes.
    """
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    known = [n.meta.get(VAL, n.meta.get(EXAMPLE_VALUE)) for n in placeholders]
    modes = [v.fake_mode for v in (*example_inputs, *known) if isinstance(v, FakeTensor)]
    mode = modes[0] if modes else None
    for node, value, meta_value in zip(placeholders, example_inputs, known, strict=False):
        if isinstance(value, FakeTensor):
            node.meta[VAL] = value
        elif not isinstance(value, torch.Tensor):  # a size: keep dynamo's SymInt if it has one
            node.meta[VAL] = (
                value if meta_value is None or isinstance(value, torch.SymInt) else meta_value
            )
        elif _agrees(meta_value, value):
            node.meta[VAL] = _requiring_grad_as(meta_value, value)
        else:
            mode = mode or FakeTensorMode(allow_non_fake_inputs=True)
            node.meta[VAL] = mode.from_tensor(value, static_shapes=True)
    return sum(VAL not in n.meta for n in placeholders)


def _requiring_grad_as(meta_value: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``meta_value``, requiring a gradient where ``value`` does: dynamo's fake of a lifted
    parameter does not, and the passes read it (the cast placement costs the casts of
    gradients)."""
    if meta_value.requires_grad == value.requires_grad or not meta_value.is_leaf:
        return meta_value
    return meta_value.detach().requires_grad_(value.requires_grad)


def _agrees(meta_value: Any, value: torch.Tensor) -> bool:
    return (
        isinstance(meta_value, torch.Tensor)
        and meta_value.dtype == value.dtype
        and meta_value.device.type == value.device.type
        and meta_value.dim() == value.dim()
    )


def sync_example_values(gm: fx.GraphModule) -> None:
    """Make dynamo's ``meta["example_value"]`` agree with the rewritten graph's dtypes.

    Inductor's pre-grad passes read it; after the passes it would describe the graph as
    captured (e.g. a float32 linear that now returns bfloat16). A node whose value the
    passes could not propagate loses the stale entry.
    """
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if VAL in node.meta:
            node.meta[EXAMPLE_VALUE] = node.meta[VAL]
        else:
            node.meta.pop(EXAMPLE_VALUE, None)


def _summary(gm: fx.GraphModule, record: CompileRecord, index: int) -> str:
    casts = sum(n.meta[AMP].role is Role.CAST for n in gm.graph.nodes)
    ops = sum(n.meta[AMP].role is Role.OP for n in gm.graph.nodes)
    return (
        f"amp_graph backend: graph {index} ({ops} ops), policy {record.policy.name}, "
        f"{short(record.dtype)}: casts kept {casts}; passes took "
        f"{1000 * sum(record.seconds.values()):.1f} ms"
    )


_DEFAULT = AmpGraphBackend("O1", None, "inductor")


def amp_graph_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable:
    """The backend registered as ``"amp_graph"``: policy O1, the device's default dtype
    (float16 on CUDA, bfloat16 on CPU), then inductor.

    Every ``torch.compile(..., backend="amp_graph")`` shares it, so :func:`captured_graphs`
    of any of them lists the graphs of all of them; use ``backend=amp_graph.backend()`` for
    a backend of one's own.
    """
    return _DEFAULT(gm, example_inputs, **kwargs)


def captured_graphs(compiled: Any) -> list[fx.GraphModule]:
    """The rewritten graphs of a ``torch.compile`` result, in the order they were compiled.

    ``compiled`` is what ``torch.compile`` returned (a module or a function) or the backend
    object itself. The graphs are those of its backend object: each :func:`backend` call
    makes a new one; ``backend="amp_graph"`` uses one shared by every such compile. Graphs
    appear once dynamo has compiled them, i.e. after the first call; a recompilation (new
    shapes or dtypes) appends another. :func:`amp_graph.report` and
    :func:`amp_graph.explain` take any of them.

    Raises:
        TypeError: ``compiled`` was not compiled with an amp_graph backend.
    """
    found = _find_backend(compiled)
    if found is None:
        raise TypeError(
            f"{type(compiled).__name__} was not compiled with the amp_graph backend; pass what "
            "torch.compile(model, backend='amp_graph' or amp_graph.backend(...)) returned"
        )
    return found.graphs


def _find_backend(obj: Any) -> AmpGraphBackend | None:
    """From a compiled module or function to our backend object: find its dynamo context,
    then follow the chain of backend wrappers (convert-frame callbacks, dynamo's debug
    wrapper, torch.compile's backend wrapper) that dynamo links by attribute."""
    if isinstance(obj, AmpGraphBackend):
        return obj
    item = getattr(_dynamo_context(obj), "callback", None)
    links = (
        "_torchdynamo_orig_backend",
        "_torchdynamo_orig_callable",
        "compiler_fn",
        "__wrapped__",
    )
    for _ in range(16):
        if isinstance(item, AmpGraphBackend):
            return item
        if item is amp_graph_backend:
            return _DEFAULT
        item = next((getattr(item, name) for name in links if _has_attr(item, name)), None)
    return None


def _dynamo_context(obj: Any) -> Any:
    """The ``_TorchDynamoContext`` of ``torch.compile``'s result: an ``OptimizedModule``'s
    ``dynamo_ctx``, or the context a compiled function's wrapper closes over."""
    from torch._dynamo.eval_frame import _TorchDynamoContext

    if isinstance(getattr(obj, "dynamo_ctx", None), _TorchDynamoContext):
        return obj.dynamo_ctx
    for cell in getattr(obj, "__closure__", None) or ():
        try:
            if isinstance(cell.cell_contents, _TorchDynamoContext):
                return cell.cell_contents
        except ValueError:  # an empty cell
            continue
    return None


def _has_attr(obj: Any, name: str) -> bool:
    try:
        return getattr(obj, name, None) is not None
    except Exception:  # properties of arbitrary objects may raise
        return False


def _entry_point_installed() -> bool:
    from importlib.metadata import entry_points

    target = f"{__name__}:amp_graph_backend"
    return any(
        ep.name == BACKEND_NAME and ep.value == target
        for ep in entry_points(group="torch_dynamo_backends")
    )


def register() -> None:
    """Make ``backend="amp_graph"`` known to dynamo; runs when this module is imported.

    An installed package declares the ``torch_dynamo_backends`` entry point, which dynamo
    loads on first use, so nothing is needed (registering too would make dynamo's own
    entry-point registration fail as a duplicate). From a source tree without the entry
    point, the backend is registered here.
    """
    if _entry_point_installed():
        return
    from torch._dynamo import list_backends, register_backend

    if BACKEND_NAME not in list_backends(exclude_tags=()):
        register_backend(amp_graph_backend, name=BACKEND_NAME)


register()

__all__ = ["AmpGraphBackend", "amp_graph_backend", "backend", "captured_graphs"]
