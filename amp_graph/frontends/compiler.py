"""``amp_graph.compile`` and ``compile_``: a model captured as an FX graph and rewritten for
mixed precision, behind the model's own call signature.

The request, the capture and the rewrite are every entry point's
(:mod:`amp_graph.frontends.front_door`). What is ``compile`` 's own: the capture at the
first call (or at once with ``example_inputs``) and again when the inputs change structure,
dtype or rank (:class:`CompiledModule`, over a
:class:`~amp_graph.frontends.capture_cache.CaptureCache`); ``compile_`` 's forward set on
the model itself; and reading the graph back (:func:`as_graph_module`,
:func:`compile_record`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import re
import warnings
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from amp_graph.capture import (
    Captured,
    CaptureError,
    capture_for_policy,
    export_refused,
)
from amp_graph.frontends.cached_decode import CachedDecoder, decodes_with_cache
from amp_graph.frontends.capture_cache import CaptureCache
from amp_graph.frontends.compile_modes import EAGER, InductorCalls, RunMode, resolve_mode
from amp_graph.frontends.front_door import COMPILE_META, CompileRecord, admit, rewrite
from amp_graph.frontends.graphed_calls import GraphedCalls, is_sharded
from amp_graph.frontends.model_forwards import (
    InplaceForward,
    SignedForward,
    forward_signature,
    graph_forward,
    in_place_capture,
    warn_method_ran_uncompiled,
)
from amp_graph.frontends.policy_request import AmpRequest
from amp_graph.passes import AMP, Role
from amp_graph.passes.classify import normalize_module_path
from amp_graph.passes.meta import short
from amp_graph.policy import Policy, check_output_dtype

log = logging.getLogger(__name__)

POLICY_OUTPUT_DTYPE = "policy"  # compile's output_dtype: the policy's Policy.output_dtype


def _summary(gm: fx.GraphModule, record: CompileRecord) -> str:
    dtypes = Counter(
        short(n.meta[AMP].out_dtype)
        for n in gm.graph.nodes
        if n.meta[AMP].role in (Role.OP, Role.USER_CAST, Role.INPLACE)
    )
    casts = sum(n.meta[AMP].role is Role.CAST for n in gm.graph.nodes)
    per_dtype = ", ".join(f"{count} {name}" for name, count in sorted(dtypes.items()))
    capture = record.seconds.get("capture")
    took = f"; capture {capture:.2f} s" if capture is not None else ""
    return (
        f"amp_graph.compile: policy {record.policy.name}, {short(record.dtype)}: ops by output "
        f"dtype {{{per_dtype}}}; casts inserted {record.stats.get('casts_inserted', 0)}, removed "
        f"{record.stats.get('casts_removed', 0)}, kept {casts}{took}"
    )


class CompiledModule(nn.Module):
    """What :func:`amp_graph.compile` returns: the model, captured and rewritten per input
    signature, behind the model's own call signature.

    The first call (or ``example_inputs``) captures the model with those inputs as fake
    tensors and rewrites the graph; later calls with the same structure, dtypes, devices,
    ranks and ``training`` flags reuse it. A second set of sizes captures once more with
    symbolic sizes, which then serves every size. ``print(compiled)``, ``.code``,
    ``.graph`` and ``.graph_module`` show the graph of the last call; ``graph_modules``
    lists all of them. Parameters and buffers are the model's own (the graph reads them from
    the model at every call).

    As torch.compile's ``OptimizedModule``: ``inspect.signature(compiled.forward)`` is the
    model's, and attributes the wrapper lacks are the model's (``compiled.config``,
    ``compiled.save_pretrained``); those methods run the model's own code, except that
    ``compiled.generate``'s calls of the model run the graph, and its KV-cache calls the
    decode graphs (:attr:`decoder`), as with :func:`amp_graph.compile_`. ``state_dict()``
    keys carry the ``_orig_mod.`` prefix, as torch.compile's do: to keep the model's class
    and keys, compile in place with :func:`amp_graph.compile_`.
    """

    def __init__(
        self,
        model: nn.Module,
        policy: Policy,
        dtype: torch.dtype,
        device_type: str,
        *,
        check_each_pass: bool = False,
        mode: RunMode = EAGER,
    ) -> None:
        super().__init__()
        self._orig_mod = model
        self.mode = mode
        self._graphed, self._inductor = self._runners(mode)
        self.policy, self.dtype, self.device_type = policy, dtype, device_type
        self.check_each_pass, self._warned_autocast = check_each_pass, False
        self._cache = self._new_cache()
        self.decoder = CachedDecoder(self)  # the calls with a KV cache
        self._last: Captured | None = None
        self._monitor: Any = None  # an amp_graph.monitoring.Monitor picks each call's graph
        self._in_place = False  # set by compile_: capture the class's forward
        self.calls = 0  # calls of the graphs (a method reached through the wrapper may make none)
        self.forward = SignedForward(self._call, forward_signature(model))

    def __getattr__(self, name: str) -> Any:
        """The model's attribute where the wrapper has none (``config``, ``generate``).
        The model's own methods (``generate``, a ``predict``) run within
        :func:`graph_forward`: the model's calls of itself run the graph, and those with a KV
        cache the decode graphs (not the model in float32)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("_modules", {}).get("_orig_mod")
            if model is None or name.startswith("__"):
                raise
            value = getattr(model, name)
            if not (inspect.ismethod(value) and value.__self__ is model):
                return value

            @functools.wraps(value)
            def through_the_graph(*args: Any, **kwargs: Any) -> Any:
                before = self.calls
                with graph_forward(self):
                    out = value(*args, **kwargs)
                if self.calls == before:
                    warn_method_ran_uncompiled(self, name, out)
                return out

            return through_the_graph

    # ---- the graphs --------------------------------------------------------------------

    @property
    def graph_module(self) -> fx.GraphModule:
        """The rewritten GraphModule of the last call."""
        if self._last is None:
            raise RuntimeError(
                f"{type(self._orig_mod).__name__} has not been captured yet: amp_graph captures "
                "it at the first call. Call the compiled module once, or pass example_inputs "
                "to amp_graph.compile."
            )
        return self._last.graph_module

    def _runners(self, mode: RunMode) -> tuple[GraphedCalls | None, InductorCalls | None]:
        """What runs the graphs in ``mode`` beside the graph itself: the CUDA-graph replays
        of ``"cudagraphs"``, or inductor's compiled graphs."""
        graphed = GraphedCalls(type(self._orig_mod).__name__) if mode.name == "cudagraphs" else None
        return graphed, InductorCalls(mode.name) if mode.inductor else None

    def _new_cache(self) -> CaptureCache:
        model = self._orig_mod
        return CaptureCache(self._capture_new, list(model.modules()), type(model).__name__)

    @property
    def graph_modules(self) -> list[fx.GraphModule]:
        """Every rewritten GraphModule, in capture order."""
        return [c.graph_module for c in self._cache.captures]

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    @property
    def code(self) -> str:
        return self.graph_module.code

    @property
    def meta(self) -> dict[str, Any]:
        return self.graph_module.meta

    @property
    def model(self) -> nn.Module:
        """The user's module (its parameters are the graph's)."""
        return self._orig_mod

    def __repr__(self) -> str:
        returned = self.policy.output_dtype  # shown where it is set: the name may not say
        head = (
            f"amp_graph.CompiledModule({type(self._orig_mod).__name__}, policy="
            f"{self.policy.name}, dtype={short(self.dtype)}, "
            + (f"output_dtype={short(returned)}, " if returned is not None else "")
            + f"mode={self.mode.name!r}, graphs={len(self.graph_modules)})"
        )
        if self._last is None:
            return f"{head}\n  (not captured yet: the first call captures it)"
        return f"{head}\n{self._last.graph_module.code.strip()}"

    def __getstate__(self) -> dict[str, Any]:
        """Pickle the model and the policy; the graphs are captured again after loading
        (they hold fake values and shape symbols tied to this process)."""
        state = self.__dict__.copy()
        state["_cache"], state["_last"], state["_monitor"] = self._new_cache(), None, None
        state["decoder"] = CachedDecoder(self)
        state["_graphed"], state["_inductor"] = self._runners(self.mode)
        return state

    # ---- calling ---------------------------------------------------------------------

    def capture(self, *args: Any, **kwargs: Any) -> fx.GraphModule:
        """Capture and rewrite for these example inputs now (nothing is computed); return the
        rewritten GraphModule. Calling the module does this on its own."""
        return self._captured_for(args, kwargs)[0].graph_module

    def _captured_for(self, args: tuple, kwargs: dict) -> tuple[Captured, list]:
        captured, leaves = self._cache.get(args, kwargs)
        self._last = captured
        return captured, leaves

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the graph for these inputs (capturing it first if needed). Replaced per
        instance by a :class:`SignedForward` that shows the model's signature."""
        return self._call(*args, **kwargs)

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_exporting():
            raise export_refused(type(self._orig_mod).__name__)
        self.calls += 1
        if decodes_with_cache(kwargs):
            return self.decoder(args, kwargs)  # a KV cache: the decode graphs
        captured, leaves = self._captured_for(args, kwargs)
        if torch.is_autocast_enabled(self.device_type) and kwargs.get("encoder_outputs") is None:
            # (an encoder-decoder's decoder call: generate under torch.autocast is what the
            # decode path advises, so that its encoder, run outside the graph, gets autocast)
            self._warn_autocast()
            with torch.autocast(self.device_type, enabled=False):
                return self._run(captured, args, kwargs, leaves)
        return self._run(captured, args, kwargs, leaves)

    def _run(self, captured: Captured, args: tuple, kwargs: dict, leaves: list) -> Any:
        choose = self._monitor and self._monitor.graph_for_step
        if self._graphed is None and self._inductor is None:
            return captured.call(leaves, choose)
        gm = captured.graph_module
        graph = gm if choose is None else choose(gm)  # a logging step runs the eager graph
        if graph is not gm:
            return captured.unflatten(graph(*leaves))
        if self._inductor is not None:
            return captured.unflatten(self._inductor.call(gm, leaves))
        assert self._graphed is not None
        replayed = self._graphed.call(gm, leaves, self._tensors)
        return captured.unflatten(gm(*leaves) if replayed is None else replayed)

    def _tensors(self) -> list[tuple[str, torch.Tensor]]:
        model = self._orig_mod
        return [*model.named_parameters(), *model.named_buffers()]

    def _warn_autocast(self) -> None:
        if not self._warned_autocast:
            self._warned_autocast = True
            warnings.warn(
                "an amp_graph compiled module was called inside torch.autocast: its graph "
                "already computes each op at the dtype its policy decides, so autocast is "
                "disabled inside it. Call it outside torch.autocast to silence this (with HF "
                "Trainer or accelerate: leave bf16/fp16 and mixed_precision off, see "
                "docs/integrations.md); for a loss computed on its outputs in float32 then, "
                "as autocast computes it, compile with output_dtype=torch.float32.",
                stacklevel=3,
            )

    def _capture_new(self, args: tuple, kwargs: dict, dynamic: bool) -> Captured:
        captured = self._capture_graph(args, kwargs, dynamic)
        gm = captured.graph_module
        request = AmpRequest(self.policy, self.dtype, self.device_type)
        record = rewrite(
            gm,
            request,
            check_each_pass=self.check_each_pass,
            seconds={"capture": captured.seconds},
            # inductor's partitioner decides what backward keeps: no saved-tensor hooks
            recompute_hooks=not self.mode.inductor,
            cuda_graphs=self.mode.cuda_graphs,
        )
        log.info("%s", _summary(gm, record))
        return captured

    def _capture_graph(self, args: tuple, kwargs: dict, dynamic: bool) -> Captured:
        """The model as captured for these inputs, before the passes (a graph of its own:
        the passes rewrite it in place). A GraphModule the user brought (torch.fx's or HF's
        tracer) is captured as any module: its code runs under the same capture, so the
        passes see one IR, aten ops with a fake value on every node."""
        model = self._orig_mod
        traced = model if isinstance(model, fx.GraphModule) else None
        if traced is not None:
            model = graph_code_module(traced)
        with in_place_capture(model) if self._in_place else contextlib.nullcontext():
            captured = capture_for_policy(
                model,
                args,
                kwargs,
                self.policy,
                self.dtype,
                device_type=self.device_type,
                dynamic=dynamic,
            )
        if traced is not None:
            carry_module_stacks(captured.graph_module, traced)
        return captured


def graph_code_module(gm: fx.GraphModule) -> nn.Module:
    """A plain module whose forward is ``gm``'s generated code, over ``gm``'s own children
    and tensors (nothing copied), under ``gm``'s class name.

    ``torch.export`` runs a GraphModule through ``fx.Interpreter`` rather than its forward,
    so the capture under the policy, which wraps the forward
    (:mod:`amp_graph.capture.planned_dtypes`),
    would never see the code run: as a plain module it runs as any model's does.
    """
    cls = type(type(gm).__name__, (nn.Module,), {"forward": type(gm).forward})
    module = cls()
    for name, child in gm.named_children():
        module.add_module(name, child)
    for name, parameter in gm.named_parameters(recurse=False):
        module.register_parameter(name, parameter)
    for name, buffer in gm.named_buffers(recurse=False):
        module.register_buffer(name, buffer)
    for node in gm.graph.nodes:  # tensors the code reads that are neither (constants)
        top = str(node.target).split(".")[0] if node.op == "get_attr" else None
        if top is not None and not hasattr(module, top):
            setattr(module, top, getattr(gm, top))
    module.training = gm.training  # not train(): the children are the user's, as they are
    return module


_ASSIGNED = re.compile(r"^\s*(\w+)\s*=")


def carry_module_stacks(captured: fx.GraphModule, traced: fx.GraphModule) -> None:
    """Give each captured node the modules its line of ``traced``'s code ran in.

    A tracer inlines the forwards it traces through (attention's matmuls, residual adds):
    ``traced``'s code calls only its leaf modules, so export records no module around the
    ops it inlined, and a module override (``modules={"blocks.0.attn": "fp32"}``) would miss
    them. The tracer kept each node's stack (``meta["nn_module_stack"]``); each captured
    node's stack trace names its line of the code, whose assigned name is the traced node.
    """
    filename = type(traced).forward.__code__.co_filename
    by_name = {node.name: node for node in traced.graph.nodes}
    for node in captured.graph.nodes:
        source = _traced_source(node.meta.get("stack_trace"), filename, by_name)
        outer = source.meta.get("nn_module_stack") if source is not None else None
        if not outer:
            continue
        # export's root entry, then the tracer's stack, then the modules export saw deeper
        # (those called inside a leaf module the traced code calls)
        outer_paths = {normalize_module_path(str(v[0])) for v in outer.values()}
        root, deeper = {}, {}
        for key, value in (node.meta.get("nn_module_stack") or {}).items():
            path = normalize_module_path(str(value[0]))
            if not path:
                root[key] = value
            elif path not in outer_paths:
                deeper[key] = value
        node.meta["nn_module_stack"] = {**root, **dict(outer), **deeper}


def _traced_source(
    stack_trace: str | None, filename: str, by_name: dict[str, fx.Node]
) -> fx.Node | None:
    """The traced node whose line of generated code (in ``filename``) computed a captured
    node: the innermost such frame's ``name = ...``."""
    if not stack_trace:
        return None
    lines = stack_trace.splitlines()
    for index in range(len(lines) - 1, -1, -1):
        if f'File "{filename}"' in lines[index] and index + 1 < len(lines):
            match = _ASSIGNED.match(lines[index + 1])
            return by_name.get(match.group(1)) if match else None
    return None


def compile(
    model: nn.Module,
    policy: Policy | str = "O1",
    dtype: torch.dtype | None = None,
    *,
    output_dtype: torch.dtype | str | None = POLICY_OUTPUT_DTYPE,
    example_inputs: Sequence[Any] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    check_each_pass: bool = False,
    mode: str | None = None,
    cuda_graph: bool | None = None,
) -> CompiledModule:
    """Rewrite ``model`` so that each op computes at the dtype ``policy`` gives it.

    Args:
        model: an ``nn.Module``, captured with ``torch.export`` (non-strict) down to aten
            ops, so every op inside every module gets the policy's decision; or a
            ``torch.fx.GraphModule`` (from other tracers), captured the same way: its node
            names become the aten graph's.
        policy: a preset name (``"O0"``, ``"O1"``, ``"O2"``, ``"O3"``, ``"autocast"``,
            ``"fp8"``) or an :class:`amp_graph.Policy`.
        dtype: the low-precision dtype, ``torch.float16`` or ``torch.bfloat16``; by default
            what torch.autocast uses on the model's device (float16 on CUDA, else bfloat16;
            bfloat16 for ``"fp8"``, whose linears compute in float8).
        output_dtype: what the outputs the graph computes in a low dtype are returned in:
            ``"policy"`` (the default), the policy's ``Policy.output_dtype``: float32 for
            ``"O2"`` and ``"O3"`` (Apex's output caster), as computed for the others, which
            is how torch.autocast returns them; ``torch.float32``; or None, as computed. With
            float32, a loss computed on the outputs outside the compiled model,
            ``loss_fn(fast(x), y)``, runs in float32, as autocast runs it when written inside
            the autocast region: its value and gradients are autocast's bit for bit.
        example_inputs / example_kwargs: the forward's arguments. Given, the model is
            captured now; otherwise at the first call, from that call's inputs. Either way
            they are used as fake tensors, so every dtype is exact and nothing is computed.
        check_each_pass: run the verifier after each dtype pass and lint the graph after
            the others (slower; the tests use it: :func:`amp_graph.passes.run_passes`).
        mode: what runs the rewritten graphs (:mod:`amp_graph.frontends.compile_modes`):
            ``"eager"`` (the GraphModule op by op), ``"cudagraphs"`` (that, each graph's
            forward and backward replayed as CUDA graphs: per input signature the first call
            with grad warms up and captures both, later calls replay them; outputs are
            overwritten by the next replay, so run backward first and clone what you keep;
            calls without grad and a monitor's logging steps run uncaptured), or a
            torch.compile mode, ``"default"``, ``"reduce-overhead"``, ``"max-autotune"``,
            ``"max-autotune-no-cudagraphs"`` (each graph through inductor at its first call;
            a monitor's logging steps run the eager graph). ``None``: by the model's device,
            ``"eager"`` on the CPU and ``"default"`` on CUDA (:data:`compile_modes.DEFAULT_MODES`:
            the choice no slower than the eager autocast loop where measured); ``"eager"``
            for a model with DTensor parameters (FSDP2, tensor parallelism), for which the
            inductor modes are refused.
        cuda_graph: deprecated; ``True`` is ``mode="cudagraphs"`` (a FutureWarning).

    Returns:
        A :class:`CompiledModule`: call it as the model. It shares the model's parameters
        and buffers (an optimizer over ``model.parameters()`` trains it; gradients arrive
        in float32) and never modifies ``model``. ``print(compiled)`` shows the graph.

    Raises:
        CaptureError: the model could not be captured; the message names the construct.
        ValueError / TypeError: bad policy, dtype, overrides or example inputs.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            "amp_graph.compile takes an nn.Module or a torch.fx.GraphModule; "
            f"got {type(model).__name__}"
        )
    if example_inputs is not None and not isinstance(example_inputs, (tuple, list)):
        raise TypeError(
            "example_inputs is a tuple of the forward's arguments, e.g. (x,); "
            f"got {type(example_inputs).__name__}"
        )
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise TypeError(f"example_kwargs is a dict; got {type(example_kwargs).__name__}")
    examples = (*(example_inputs or ()), *(example_kwargs or {}).values())
    if examples and not any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(examples)):
        raise ValueError(
            "none of example_inputs is a tensor; pass the tensors the model is called with"
        )
    request = admit(policy, dtype, model, examples)
    if output_dtype != POLICY_OUTPUT_DTYPE:  # as Apex's initialize arguments over opt levels
        check_output_dtype(output_dtype, "output_dtype")
        returned_in = dataclasses.replace(request.policy, output_dtype=output_dtype)
        request = dataclasses.replace(request, policy=returned_in)
    run_mode = resolve_mode(mode, cuda_graph, request.device_type, is_sharded(model.parameters()))
    compiled = CompiledModule(
        model,
        request.policy,
        request.dtype,
        request.device_type,
        check_each_pass=check_each_pass,
        mode=run_mode,
    )
    if example_inputs is not None or example_kwargs is not None:
        args, kwargs = tuple(example_inputs or ()), dict(example_kwargs or {})
        _check_fits_forward(model, args, kwargs)
        if isinstance(model, fx.GraphModule):
            placeholders = [n for n in model.graph.nodes if n.op == "placeholder"]
            if len(args) + len(kwargs) > len(placeholders):
                raise ValueError(
                    f"{len(args) + len(kwargs)} example inputs for a graph with "
                    f"{len(placeholders)} inputs ({', '.join(p.name for p in placeholders)})"
                )
        compiled.capture(*args, **kwargs)
    return compiled


def compile_(
    model: nn.Module,
    policy: Policy | str = "O1",
    dtype: torch.dtype | None = None,
    *,
    output_dtype: torch.dtype | str | None = POLICY_OUTPUT_DTYPE,
    example_inputs: Sequence[Any] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    check_each_pass: bool = False,
    mode: str | None = None,
) -> nn.Module:
    """Compile ``model`` in place, as ``nn.Module.compile()`` does for torch.compile: the
    model stays the user's object (its class, attributes, ``state_dict()`` keys,
    ``save_pretrained``, ``generate``), and its ``forward`` runs the amp_graph graph.

    A separate function, not a flag of :func:`compile`: it mutates ``model`` and returns it,
    where :func:`compile` never touches the model and returns a wrapper (the trailing
    underscore is PyTorch's mark of an in-place function, as ``nn.init.normal_``).

    The graph is set as an instance attribute ``forward`` (nothing global is patched); the
    capture still traces the class's forward. ``inspect.signature(model.forward)`` is the
    model's. Calls that decode with a KV cache (``cache`` / ``past_key_values`` given or
    ``use_cache=True``, as HF ``generate`` makes) run graphs whose inputs and outputs are the
    cache's tensors (:mod:`amp_graph.frontends.cached_decode`; a cache that cannot be one
    graph's decodes under torch.autocast, said at WARNING); for training, HF models want
    ``config.use_cache = False``. :func:`uncompile` undoes it;
    :func:`as_graph_module` reads the graph.

    Args and Raises: as :func:`compile`; also ``ValueError`` for a model whose ``forward`` is
    already an instance attribute (compiled in place already, or wrapped by another library),
    and ``TypeError`` for a ``torch.fx.GraphModule`` (compile it with :func:`compile`).

    Returns:
        ``model`` itself.
    """
    if isinstance(model, fx.GraphModule):
        raise TypeError(
            "amp_graph.compile_ compiles a model's code; compile a GraphModule with "
            "amp_graph.compile"
        )
    if isinstance(model, nn.Module) and "forward" in model.__dict__:
        already = isinstance(model.__dict__["forward"], InplaceForward)
        raise ValueError(
            f"{type(model).__name__} "
            + (
                "is compiled in place already; amp_graph.uncompile(model) undoes it"
                if already
                else "has a forward set on the instance (another wrapper?); amp_graph.compile_ "
                "sets its own there: compile the model before wrapping it, or use "
                "amp_graph.compile"
            )
        )
    compiled = compile(
        model,
        policy,
        dtype,
        output_dtype=output_dtype,
        example_inputs=example_inputs,
        example_kwargs=example_kwargs,
        check_each_pass=check_each_pass,
        mode=mode,
    )
    compiled._in_place = True
    model.__dict__["forward"] = InplaceForward(compiled, forward_signature(model))
    return model


def uncompile(model: nn.Module) -> nn.Module:
    """Undo :func:`compile_`: ``model.forward`` is its class's again. Returns ``model``."""
    if not isinstance(model.__dict__.get("forward"), InplaceForward):
        raise ValueError(
            f"{type(model).__name__} was not compiled in place by amp_graph.compile_"
            + (
                " (its forward is set by something else, which wraps amp_graph's: undo that first)"
                if "forward" in model.__dict__
                else ""
            )
        )
    del model.__dict__["forward"]
    return model


def compiled_in_place(model: Any) -> CompiledModule | None:
    """The :class:`CompiledModule` behind a model :func:`compile_` compiled, or None; also
    through wrappers set over its forward with ``functools.wraps`` (accelerate's autocast)."""
    forward = getattr(model, "__dict__", {}).get("forward")  # unwrap(None) is None
    forward = inspect.unwrap(forward, stop=lambda f: isinstance(f, InplaceForward))
    return forward.compiled if isinstance(forward, InplaceForward) else None


def _check_fits_forward(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """A clear error for example inputs the forward cannot take (before any tracing)."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as error:
        raise TypeError(
            f"example inputs do not fit {type(model).__name__}.forward{signature}: {error}"
        ) from None


def unwrap(compiled: Any) -> Any:
    """A :class:`CompiledModule`'s current GraphModule (or that of a model :func:`compile_`
    compiled); anything else as it is: for tools that also take a graph amp_graph did not
    make (``draw``, ``diff``). Where it must be amp_graph's, :func:`as_graph_module`."""
    compiled = compiled_in_place(compiled) or compiled
    return compiled.graph_module if isinstance(compiled, CompiledModule) else compiled


def as_graph_module(compiled: Any) -> fx.GraphModule:
    """The rewritten GraphModule behind what ``compile``, ``compile_``, the backend or
    ``Graph`` made; a TypeError for anything else (:func:`unwrap` passes it through)."""
    compiled = compiled_in_place(compiled) or compiled
    if isinstance(compiled, CompiledModule):
        return compiled.graph_module
    if isinstance(compiled, fx.GraphModule) and COMPILE_META in getattr(compiled, "meta", {}):
        return compiled
    raise TypeError(
        f"{type(compiled).__name__} was not produced by amp_graph.compile (or by the "
        "amp_graph backend); pass the module amp_graph.compile returned"
    )


def compile_record(compiled: Any) -> CompileRecord:
    """The record ``compile`` left on a compiled graph; a clear error for other modules."""
    return as_graph_module(compiled).meta[COMPILE_META]


__all__ = [
    "CaptureCache",
    "CaptureError",
    "CompileRecord",
    "CompiledModule",
    "as_graph_module",
    "compile",
    "compile_",
    "compile_record",
    "compiled_in_place",
    "uncompile",
    "unwrap",
]
