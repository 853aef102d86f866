"""The ``forward``s amp_graph sets on a model's instance (one job: which code a call of the
model runs).

* :class:`SignedForward`: the wrapper's ``forward``; it runs the graph and shows the model's
  signature.
* :class:`InplaceForward`: what :func:`~amp_graph.compile_` sets as ``model.forward``: the
  same (calls that decode with a KV cache run the decode graphs,
  :mod:`amp_graph.frontends.cached_decode`), marked as the compiled model's.
* :func:`class_forward`: while active, the class's own forward again (for a capture).
* :func:`in_place_capture`: the same, without the model's own forward hooks
  (:func:`own_hooks_hidden`: ``nn.Module.__call__`` runs them around the forward
  ``compile_`` set).
* :func:`graph_forward`: while active, a :class:`~amp_graph.frontends.compiler.CompiledModule`'s
  model calls itself as if compiled in place, so that its own methods that call it
  (HF ``generate``) run the graph and the decode graphs, not the model in float32;
  :func:`warn_method_ran_uncompiled` says when such a method computed without calling it.

Nothing global is patched: each sets or removes one instance attribute.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

log = logging.getLogger(__name__)

# ``compiled`` below is a CompiledModule (typed Any: compiler imports this module).


class SignedForward:
    """A ``forward`` set as an instance attribute: calls ``run`` and shows the model's
    signature to ``inspect.signature`` (HF ``Trainer``, ``generate``) and ``run``'s code to
    torch.export. A callable object, not a closure: ``copy.deepcopy`` rebinds ``run``."""

    def __init__(self, run: Callable[..., Any], signature: inspect.Signature | None) -> None:
        self.run = run
        if signature is not None:
            self.__signature__ = signature

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)

    @property
    def __code__(self) -> Any:  # torch.export reads it, then meets _call's refusal
        return self.run.__code__


def forward_signature(model: nn.Module) -> inspect.Signature | None:
    """The signature of ``model``'s forward, or None where inspect cannot tell."""
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None


class InplaceForward(SignedForward):
    """The ``forward`` :func:`compile_` sets on a model: the compiled model's call (its graph;
    for calls that decode with a KV cache, as HF ``generate`` makes, its
    :class:`~amp_graph.frontends.cached_decode.CachedDecoder`), marked with the compiled
    model it runs."""

    def __init__(self, compiled: Any, signature: inspect.Signature | None) -> None:
        super().__init__(compiled._call, signature)
        self.compiled = compiled


@contextlib.contextmanager
def class_forward(model: nn.Module) -> Iterator[None]:
    """While active, ``model.forward`` is its class's again: for a model :func:`compile_`
    compiled, the capture traces the model's own code, not the graph set on the instance
    (nor a wrapper another library set over it, as accelerate's autocast)."""
    if "forward" not in model.__dict__:
        yield
        return
    forward = model.__dict__["forward"]
    del model.__dict__["forward"]
    try:
        yield
    finally:
        model.__dict__["forward"] = forward


# nn.Module's dicts of forward hooks and pre-hooks (torch/nn/modules/module.py)
_FORWARD_HOOKS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


@contextlib.contextmanager
def own_hooks_hidden(model: nn.Module) -> Iterator[None]:
    """While active, ``model`` has no forward hooks or pre-hooks of its own (its submodules
    keep theirs): for a capture whose graph runs inside ``model``'s ``nn.Module.__call__``,
    which runs them around it, so that the graph does not run them a second time."""
    hooks = {name: model.__dict__[name] for name in _FORWARD_HOOKS if name in model.__dict__}
    for name in hooks:
        model.__dict__[name] = type(hooks[name])()
    try:
        yield
    finally:
        model.__dict__.update(hooks)


@contextlib.contextmanager
def in_place_capture(model: nn.Module) -> Iterator[None]:
    """While active, a capture of a model :func:`~amp_graph.compile_` compiled traces its
    class's forward (:func:`class_forward`) without the model's own forward hooks
    (:func:`own_hooks_hidden`): every call of such a model passes through
    ``nn.Module.__call__``, which runs them around the forward ``compile_`` set."""
    with own_hooks_hidden(model), class_forward(model):
        yield


@contextlib.contextmanager
def graph_forward(compiled: Any) -> Iterator[None]:
    """While active, ``compiled``'s model (a :class:`CompiledModule`'s) runs as if
    :func:`~amp_graph.compile_` had compiled it: its calls of itself run ``compiled``'s graph,
    and those with a KV cache run its decode graphs. The captures made meanwhile trace
    the class's forward, as the wrapper's do.

    A model whose ``forward`` is set on the instance by something else (another wrapper) is
    left as it is, with a WARNING that its method runs its own code in float32."""
    model = compiled.model
    installed = model.__dict__.get("forward")
    if isinstance(installed, InplaceForward) and installed.compiled is compiled:
        yield  # a method of the model reached through the wrapper within another: installed
        return
    if installed is not None:
        log.warning(
            "amp_graph: %s.forward is set on the instance by something else, so the methods "
            "of the model reached through the compiled wrapper (generate) run the model's "
            "own code, in float32, not the graph. Compile the model before wrapping it, or "
            "compile it in place with amp_graph.compile_",
            type(model).__name__,
        )
        yield
        return
    in_place = compiled._in_place
    compiled._in_place = True  # a capture meanwhile must not trace the forward set below
    model.__dict__["forward"] = InplaceForward(compiled, forward_signature(model))
    try:
        yield
    finally:
        del model.__dict__["forward"]
        compiled._in_place = in_place


def warn_method_ran_uncompiled(compiled: Any, name: str, out: Any) -> None:
    """A method of ``compiled``'s model reached through the wrapper returned floating-point
    tensors (not the model's own parameters or buffers) without calling the model: it
    called submodules directly (diffusers' ``AutoencoderKL.decode`` calls ``self.decoder``),
    which ran uncompiled, in float32. Said once per method, at WARNING."""
    said = compiled.__dict__.setdefault("_uncompiled_methods", set())
    if name in said or not _computed_tensors(compiled.model, out):
        return
    said.add(name)
    model = type(compiled.model).__name__
    log.warning(
        "amp_graph: %s.%s, called through the compiled wrapper, returned tensors without "
        "calling the model's forward: the submodules it calls directly ran uncompiled, in "
        "float32. Compile the submodule it calls (amp_graph.compile_(model.<submodule>, "
        "...)), or call the method under torch.autocast.",
        model,
        name,
    )


def _computed_tensors(model: nn.Module, out: Any) -> bool:
    """Whether ``out`` holds a floating-point tensor that is not one of ``model``'s
    parameters or buffers (a getter's return)."""
    own = {id(t) for t in (*model.parameters(), *model.buffers())}
    return any(
        isinstance(t, torch.Tensor) and t.is_floating_point() and id(t) not in own
        for t in pytree.tree_leaves(out)
    )
