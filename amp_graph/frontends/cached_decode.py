"""Decoding with a KV cache as graphs: the cache's tensors are a graph's inputs and outputs.

HF ``generate`` calls the model with a cache object (``cache=`` in transformers 5, or
``past_key_values=``): Python state that ``torch.export`` cannot take as an input or return.
:class:`CachedDecoder` captures such a call anyway, through the front door, so that every op
of the prefill and of each decode step gets the policy's dtype (its tables, overrides,
O2/O3's low-precision model), as the model's forward does:

* the cache's tensors (each layer's ``keys``, ``values``, a static cache's position) become
  graph inputs; in the trace the model sees a copy of the cache object holding them
  (:func:`cache_layout`, :func:`_rebuilt`);
* after the forward, the tensors the model put in the cache (a dynamic cache concatenates)
  are graph outputs, and a cache the model created is rebuilt from them; tensors written in
  place (a static cache's ``index_copy_``) are the graph's input mutations, copied back into
  the user's tensors as torch.export records them;
* the step's Python state must be a fixed point: a layer filled for the first time may
  change its attributes (``is_initialized``), a filled one may not (a sliding window's
  counter), since a graph would bake them.

The captures are keyed by the cache's layout (its class, each layer's class and Python
state), then as any capture is (:class:`~amp_graph.frontends.capture_cache.CaptureCache`),
symbolic sizes first: one graph serves every length of a growing cache. Each weight is cast
once per generation, as under one torch.autocast around ``generate``: the graphs' casts of
parameters are reused while the KV cache object they served lives
(:mod:`amp_graph.ops.parameter_casts`). A cache whose step
cannot be one graph decodes under torch.autocast in the policy's dtype, said once at WARNING
with the reason (:meth:`CachedDecoder._under_autocast`): from its prefill where the prefill
shows it (a sliding window's counter, :func:`_rewritten`), so no graph writes a cache that
torch.autocast then writes, and every later call of that cache object alike.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from amp_graph.capture import Captured, CaptureError, capture_autocast
from amp_graph.frontends.capture_cache import CaptureCache
from amp_graph.frontends.front_door import admit, capture_and_rewrite
from amp_graph.frontends.model_forwards import own_hooks_hidden
from amp_graph.frontends.policy_request import AmpRequest
from amp_graph.ops.parameter_casts import ParameterCasts
from amp_graph.passes.meta import short
from amp_graph.passes.reuse_parameter_casts import reuse_parameter_casts
from amp_graph.policy import Policy

log = logging.getLogger(__name__)

CACHE_KWARGS = ("cache", "past_key_values")  # transformers 5 names it cache, 4 the other
# what a cache's Python state may hold: values a graph may be specialized on (a SymInt is
# none of these: state that depends on a symbolic size cannot be baked)
_PLAIN = (type(None), bool, int, float, str, torch.device, torch.dtype, type)


def cache_kwarg(kwargs: dict[str, Any]) -> str | None:
    """The keyword a call passes its KV cache by, if any."""
    return next((name for name in CACHE_KWARGS if kwargs.get(name) is not None), None)


def decodes_with_cache(kwargs: dict[str, Any]) -> bool:
    """Whether a call decodes with a KV cache: a cache given, or ``use_cache=True`` (HF
    ``generate`` makes both)."""
    return cache_kwarg(kwargs) is not None or bool(kwargs.get("use_cache"))


class UncapturedCache(Exception):
    """Why a cache's step cannot be one graph (the message is the reason)."""


@dataclass(frozen=True)
class CacheLayout:
    """A cache object as a capture is specialized on it: its class and Python state, each
    layer's class and Python state, and where its tensors are (layer, attribute), in the
    order they are the graph's inputs. Caches of one layout take the same graphs."""

    cache_type: type
    state: tuple[tuple[str, Any], ...]
    layers: tuple[tuple[type, tuple[tuple[str, Any], ...]], ...]
    tensors: tuple[tuple[int, str], ...]


def _state_and_tensors(obj: Any, where: str) -> tuple[tuple, list[str]]:
    """``obj``'s plain attributes and the names of its tensor attributes."""
    state, tensors = [], []
    for name, value in vars(obj).items():
        if isinstance(value, torch.Tensor):
            tensors.append(name)
        elif isinstance(value, _PLAIN):
            state.append((name, value))
        else:
            raise UncapturedCache(
                f"{where}.{name} is a {type(value).__name__}, state one graph cannot take"
            )
    return tuple(state), tensors


def cache_layout(cache: Any) -> CacheLayout:
    """The layout of a transformers ``Cache`` (a list of ``layers``, each holding tensors
    and plain values). Raises :class:`UncapturedCache` for any other kind of cache."""
    name = type(cache).__name__
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list) or not hasattr(cache, "__dict__"):
        raise UncapturedCache(
            f"the cache ({name}) is not a transformers Cache with a list of layers"
        )
    if getattr(cache, "offloading", False):
        raise UncapturedCache(f"the cache ({name}) offloads its layers to the CPU between uses")
    own = {k: v for k, v in vars(cache).items() if k != "layers"}
    state = []
    for key, value in own.items():
        if not isinstance(value, _PLAIN):  # a tensor too: only layers hold tensors
            raise UncapturedCache(f"{name}.{key} is a {type(value).__name__}")
        state.append((key, value))
    described, tensors = [], []
    for index, layer in enumerate(layers):
        layer_state, names = _state_and_tensors(layer, f"{name}.layers[{index}]")
        described.append((type(layer), layer_state))
        tensors += [(index, attribute) for attribute in names]
    return CacheLayout(type(cache), tuple(state), tuple(described), tuple(tensors))


def _stripped(obj: Any) -> Any:
    """A shallow copy of ``obj`` without its tensors (a template: nothing traced survives)."""
    clone = copy.copy(obj)
    for name, value in vars(obj).items():
        if isinstance(value, torch.Tensor):
            setattr(clone, name, None)
    return clone


def _rewritten(before: tuple, after: tuple, filled: bool) -> list[str]:
    """The plain attributes of a cache layer that a write changed and every write will change
    again. Once the layer is filled: any. At its first fill (the prefill): those it held a
    value of before (a sliding window's token counter, 0 before), not those the fill sets
    (the flag ``is_initialized``, its sizes and device, None or absent before). Found at the
    prefill, the refusal comes before anything is written into the cache, so the prefill and
    every step of that cache decode alike under torch.autocast."""
    if filled:
        return sorted({key for key, _ in set(after) ^ set(before)})
    now = dict(after)
    return sorted(
        key
        for key, value in before
        if key != "is_initialized" and value is not None and now.get(key, value) != value
    )


def _template(cache: Any) -> Any:
    template = copy.copy(cache)
    template.layers = [_stripped(layer) for layer in cache.layers]
    return template


def _rebuilt(template: Any, where: tuple[tuple[int, str], ...], tensors: Any) -> Any:
    """A cache object like ``template`` holding ``tensors`` at ``where``."""
    cache = copy.copy(template)
    cache.layers = [copy.copy(layer) for layer in template.layers]
    for (index, attribute), tensor in zip(where, tensors, strict=True):
        setattr(cache.layers[index], attribute, tensor)
    return cache


@dataclass(frozen=True)
class CacheWrite:
    """What one decode graph does to a cache of its output: the position of the cache among
    the output's leaves, whether it is the cache the call passed (else one the model made),
    the cache after the step without its tensors, the plain attributes the step set on the
    passed cache's layers, and where the tensors the graph returns for it go."""

    leaf: int
    passed: bool
    template: Any
    states: tuple[tuple[int, str, Any], ...]
    tensors: tuple[tuple[int, str], ...]

    def apply(self, passed: Any, tensors: Iterator[torch.Tensor]) -> Any:
        """The cache object after the step, its new tensors taken from ``tensors``."""
        if not self.passed:
            return _rebuilt(self.template, self.tensors, [next(tensors) for _ in self.tensors])
        for layer in self.template.layers[len(passed.layers) :]:
            passed.layers.append(copy.copy(layer))  # layers the step appended
        for index, attribute, value in self.states:
            setattr(passed.layers[index], attribute, value)
        for index, attribute in self.tensors:
            setattr(passed.layers[index], attribute, next(tensors))
        return passed


@dataclass(frozen=True)
class StepPlan:
    """How a decode graph's output becomes the model's: its leaves with each cache left out,
    their structure, and the caches to put back."""

    spec: pytree.TreeSpec
    writes: tuple[CacheWrite, ...]


class DecodeForward:
    """The forward a decode capture traces, set on the model while export runs: it rebuilds
    the cache from its tensors, runs the model's class forward, and returns the output's
    leaves (each cache left out) beside the tensors the step put in the caches. What it
    found is :attr:`plan`; why it refused, :attr:`refused`."""

    def __init__(
        self, model: nn.Module, kwarg: str | None, layout: CacheLayout | None, template: Any
    ) -> None:
        self.model, self.kwarg, self.layout, self.template = model, kwarg, layout, template
        self.plan: StepPlan | None = None
        self.refused: str | None = None

    def __call__(self, args: tuple, kwargs: dict, tensors: list) -> Any:
        try:
            return self._step(args, kwargs, tensors)
        except UncapturedCache as refusal:
            self.refused = str(refusal)
            raise

    def _step(self, args: tuple, kwargs: dict, tensors: list) -> Any:
        passed = None
        if self.kwarg is not None:
            assert self.layout is not None
            passed = _rebuilt(self.template, self.layout.tensors, tensors)
            kwargs = {**kwargs, self.kwarg: passed}
        out = type(self.model).forward(self.model, *args, **kwargs)
        leaves, spec = pytree.tree_flatten(out)
        writes, returned = [], []
        for position, leaf in enumerate(leaves):
            if isinstance(leaf, (torch.Tensor, *_PLAIN)):
                continue
            if leaf is passed:
                write = self._passed_write(position, passed, tensors)
            else:
                write = self._made_write(position, leaf)
            writes.append(write)
            returned += [getattr(leaf.layers[i], a) for i, a in write.tensors]
            leaves[position] = None
        self.plan = StepPlan(spec, tuple(writes))
        return leaves, returned

    def _passed_write(self, position: int, cache: Any, tensors: list) -> CacheWrite:
        """The passed cache after the step: its Python state may change only in layers that
        held no tensor before (filled for the first time)."""
        assert self.layout is not None
        after = cache_layout(cache)
        name = self.layout.cache_type.__name__
        if after.state != self.layout.state:
            raise UncapturedCache(f"the {name}'s own Python state changes in a step")
        inputs = dict(zip(self.layout.tensors, tensors, strict=True))
        held = {index for index, _ in self.layout.tensors}
        states = []
        for index, (kind, state) in enumerate(after.layers[: len(self.layout.layers)]):
            before = self.layout.layers[index][1]
            if state == before:
                continue
            filled = dict(before).get("is_initialized", index in held)
            changed = _rewritten(before, state, filled)
            if changed:
                raise UncapturedCache(
                    f"{kind.__name__} (layer {index} of the {name}) changes its Python "
                    f"state {', '.join(changed)} in every step, which one graph would bake"
                )
            states += [(index, key, value) for key, value in state if (key, value) not in before]
        new = tuple(
            key
            for key in after.tensors
            if key not in inputs or getattr(cache.layers[key[0]], key[1]) is not inputs[key]
        )
        return CacheWrite(position, True, _template(cache), tuple(states), new)

    def _made_write(self, position: int, leaf: Any) -> CacheWrite:
        """A cache the model made in the step (``use_cache=True`` without one)."""
        try:
            layout = cache_layout(leaf)
        except UncapturedCache as refusal:
            raise UncapturedCache(
                f"the output holds a {type(leaf).__name__}, which is not a tensor ({refusal})"
            ) from None
        return CacheWrite(position, False, _template(leaf), (), layout.tensors)


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class CachedDecoder:
    """The calls of a compiled model that carry a KV cache (``cache=`` / ``past_key_values=``
    given, or ``use_cache=True``): each runs a graph captured for its cache's layout and
    rewritten under the model's policy (:mod:`amp_graph.frontends.cached_decode`), or, for a
    cache whose step cannot be one graph, the class's forward under torch.autocast in the
    policy's dtype, said once at WARNING with the reason."""

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled  # a CompiledModule (typed Any: compiler imports this)
        self._request: AmpRequest | None = None
        self._graphs: dict[tuple, CaptureCache] = {}
        self._plans: dict[int, StepPlan] = {}
        self._refused: dict[tuple, str] = {}
        # the caches decoding under torch.autocast, with the reason: one cache object (one
        # generation) is not written by a graph after torch.autocast wrote it
        self._eager: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self._warned: set[str] = set()
        self._casts = ParameterCasts()  # the weights' casts, shared by one cache's steps

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the caches decoding under torch.autocast (weak references: they
        belong to this process's generations)."""
        return {k: v for k, v in self.__dict__.items() if k != "_eager"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _eager=weakref.WeakKeyDictionary())

    @property
    def graph_modules(self) -> list:
        """Every decode graph, in capture order per cache layout."""
        return [c.graph_module for graphs in self._graphs.values() for c in graphs.captures]

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        request = self._admitted(args, kwargs)
        if kwargs.get("encoder_outputs") is not None:
            self._warn_encoder_ran_outside(request)
        kwarg = cache_kwarg(kwargs)
        passed = kwargs[kwarg] if kwarg is not None else None
        try:
            layout = cache_layout(passed) if passed is not None else None
        except UncapturedCache as refusal:
            return self._under_autocast(request, str(refusal), args, kwargs)
        key = (kwarg, layout)
        reason = self._refused.get(key) or (self._eager.get(passed) if layout else None)
        if reason is None:
            others = {k: v for k, v in kwargs.items() if k != kwarg}
            tensors = [getattr(passed.layers[i], a) for i, a in layout.tensors] if layout else []
            graphs = self._graphs.get(key)
            if graphs is None:
                graphs = self._graphs[key] = self._new_graphs(request, kwarg, layout, passed)
            try:
                captured, leaves = graphs.get((args, others, tensors), {})
            except CaptureError as error:
                reason = self._refused[key] = _first_line(error)
            else:
                return self._run(captured, leaves, passed)
        if layout is not None:
            self._eager[passed] = reason
        return self._under_autocast(request, reason, args, kwargs, passed)

    def _warn_encoder_ran_outside(self, request: AmpRequest) -> None:
        """An encoder-decoder model's ``generate`` runs the encoder itself
        (``model.get_encoder()(...)``) before it calls the model: outside the compiled
        forward, in float32 unless torch.autocast is on around it. Said once at WARNING."""
        if "encoder" in self._warned or request.policy.casts_nothing:
            return
        if torch.is_autocast_enabled(request.device_type):
            return  # the encoder ran under the user's torch.autocast
        self._warned.add("encoder")
        log.warning(
            "amp_graph: %s's generate ran its encoder (model.get_encoder()) itself, outside "
            "the compiled forward, so the encoder computed in float32, not at policy %s's "
            "dtypes; only the decoder's calls are amp_graph's. For the encoder in %s too, "
            "call generate under torch.autocast(%r, dtype=%s): the encoder then gets "
            "torch.autocast's dtypes",
            type(self.compiled.model).__name__,
            request.policy.name,
            short(request.dtype),
            request.device_type,
            request.dtype,
        )

    def _admitted(self, args: tuple, kwargs: dict) -> AmpRequest:
        """The compiled model's request, admitted once (its overrides were matched when it
        was compiled); node overrides left out: they name the forward's nodes, and a decode
        graph's node of one name may be another op; ``output_dtype`` left out: a decode
        graph returns its outputs as computed."""
        if self._request is None:
            compiled = self.compiled
            request = admit(compiled.policy, compiled.dtype, compiled.model, (args, kwargs))
            policy = request.policy
            if policy.nodes:
                log.warning(
                    "amp_graph: the node overrides of policy %s (%s) name nodes of %s's "
                    "forward graph and are not applied to its decode graphs (calls with a KV "
                    "cache), whose nodes are others; override modules instead (modules=...)",
                    policy.name,
                    ", ".join(sorted(policy.nodes)),
                    type(compiled.model).__name__,
                )
                policy = dataclasses.replace(policy, nodes={})
            # a decode graph returns the caches' tensors, which the next step reads low; HF
            # generate reads the logits in float32 itself
            policy = dataclasses.replace(policy, output_dtype=None)
            self._request = dataclasses.replace(request, policy=policy)
        return self._request

    def _new_graphs(
        self, request: AmpRequest, kwarg: str | None, layout: CacheLayout | None, passed: Any
    ) -> CaptureCache:
        model = self.compiled.model
        template = _template(passed) if passed is not None else None

        def capture(args: tuple, kwargs: dict, dynamic: bool) -> Captured:
            forward = DecodeForward(model, kwarg, layout, template)
            installed = model.__dict__.get("forward")
            model.__dict__["forward"] = forward  # what export traces (removed after)
            # compiled in place, the model's own hooks run in its __call__, around the graph
            own_hooks = own_hooks_hidden(model) if self.compiled._in_place else None
            try:
                with own_hooks or contextlib.nullcontext():
                    captured = capture_and_rewrite(
                        model,
                        args,
                        kwargs,
                        request,
                        check_nodes=False,
                        check_each_pass=self.compiled.check_each_pass,
                        dynamic=dynamic,
                    )
            except (CaptureError, UncapturedCache) as error:
                if forward.refused is not None:
                    raise CaptureError(forward.refused) from error
                raise
            finally:
                if installed is None:
                    del model.__dict__["forward"]
                else:
                    model.__dict__["forward"] = installed
            assert forward.plan is not None
            self._plans[id(captured)] = forward.plan
            reuse_parameter_casts(captured.graph_module, self._casts)
            return captured

        what = f"{type(model).__name__} decoding with a KV cache"
        return CaptureCache(capture, list(model.modules()), what, symbolic_first=True)

    def _run(self, captured: Captured, leaves: list, passed: Any) -> Any:
        plan = self._plans[id(captured)]
        device_type = self.compiled.device_type
        if torch.is_autocast_enabled(device_type):
            self.compiled._warn_autocast()
        self._casts.serve(passed)
        with torch.autocast(device_type, enabled=False):  # the graph decides every dtype
            out_leaves, new = captured.call(leaves)
        out_leaves, tensors = list(out_leaves), iter(new)
        caches = []
        for write in plan.writes:
            out_leaves[write.leaf] = write.apply(passed, tensors)
            caches.append(out_leaves[write.leaf])
        self._casts.keep_for(caches[0] if len(caches) == 1 else None)
        return pytree.tree_unflatten(out_leaves, plan.spec)

    def _under_autocast(
        self, request: AmpRequest, reason: str, args: tuple, kwargs: dict, cache: Any = None
    ) -> Any:
        """The class's forward under torch.autocast in the policy's dtype (none for O0):
        torch.autocast's decisions, exactly the policy's only for ``"autocast"``. What it
        writes into ``cache`` keeps the dtypes the cache holds
        (:func:`_writes_at_held_dtypes`)."""
        model = self.compiled.model
        low = None if request.policy.casts_nothing else request.dtype
        if reason not in self._warned:
            self._warned.add(reason)
            autocast_policy = Policy.preset("autocast", request.device_type)
            exact = low is None or request.policy == dataclasses.replace(
                autocast_policy, missing_kernels=request.policy.missing_kernels
            )
            log.log(
                logging.INFO if exact else logging.WARNING,
                "amp_graph: %s called with a KV cache runs its own forward eagerly under "
                "torch.autocast(%r, %s), not as a graph: %s. torch.autocast's decisions "
                "then, not all of policy %s's (its own tables, overrides, O2/O3's "
                "low-precision model), for the prefill and every step of this cache. A "
                "transformers DynamicCache or StaticCache (generate's default, or "
                "cache_implementation='static') decodes as graphs unless a layer counts "
                "tokens in Python (a sliding window's)",
                type(model).__name__,
                request.device_type,
                short(low) if low is not None else "disabled",
                reason,
                request.policy.name,
            )
        with capture_autocast(request.device_type, low), _writes_at_held_dtypes(cache):
            return type(model).forward(model, *args, **kwargs)


@contextlib.contextmanager
def _writes_at_held_dtypes(cache: Any) -> Iterator[None]:
    """While an eager call runs, each filled layer of ``cache`` stores the keys and values it
    is given at the dtypes it holds. A cache filled by a graph (the one a graph made, or a
    step refused after the prefill's graph) holds O2's bf16 keys, where torch.autocast
    computes float32 ones (RoPE multiplies by float32 cos): a static layer's ``index_copy_``
    would raise, a dynamic layer's ``cat`` would silently make the whole cache float32.
    HF's ``update`` stores what it is given, so the layers' own ``update`` is wrapped for
    the call, then restored."""
    layers = [
        layer
        for layer in getattr(cache, "layers", None) or ()
        if isinstance(getattr(layer, "keys", None), torch.Tensor)
        and isinstance(getattr(layer, "values", None), torch.Tensor)
    ]
    own = [vars(layer).get("update") for layer in layers]
    for layer in layers:
        layer.update = functools.partial(_update_at_held_dtypes, layer, layer.update)
    try:
        yield
    finally:
        for layer, update in zip(layers, own, strict=True):
            if update is None:
                del layer.update
            else:
                layer.update = update


def _update_at_held_dtypes(
    layer: Any, update: Any, keys: torch.Tensor, values: torch.Tensor, *args: Any, **kwargs: Any
) -> Any:
    return update(keys.to(layer.keys.dtype), values.to(layer.values.dtype), *args, **kwargs)


__all__ = [
    "CACHE_KWARGS",
    "CacheLayout",
    "CacheWrite",
    "CachedDecoder",
    "DecodeForward",
    "StepPlan",
    "UncapturedCache",
    "cache_kwarg",
    "cache_layout",
    "decodes_with_cache",
]
