"""Capture of a model sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``).

``torch.export`` cannot trace FSDP2's forward hooks: the pre-forward hook all-gathers the
parameter shards (a collective on fake tensors) and swaps the module's parameters. So
:func:`fsdp_units_unsharded` captures the model as the hooks leave it in the middle of a
forward: every FSDP unit unsharded (``FSDPModule.unshard()``, a collective: every rank
captures together, as every rank runs forward together), and the hooks detached from the
modules for the duration of the export, so that the graph records the model's own ops on
its full, unsharded parameters. Afterwards the hooks are put back where they were in
their modules' hook dicts and the units resharded, also when the export fails.

The hooks come back as graph nodes: :func:`amp_graph.passes.fsdp_hooks.fsdp_hooks` calls
them at each unit's boundary, as eager execution does. The unit paths this module finds
are its input (``gm.meta["amp_graph.fsdp_units"]``).

FSDP's own mixed precision (``MixedPrecisionPolicy(param_dtype=..., output_dtype=...)``)
is refused: amp_graph casts each op's inputs itself, and a second set of casts inside the
hooks, which the capture cannot see, would give the graph values of other dtypes than the
ones it was planned for (:class:`UnsupportedFSDP`, raised as a ``CaptureError``).
``reduce_dtype`` is fine (it is the gradient reduce-scatter's).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.nn as nn


def fsdp_module_type() -> type | None:
    """``torch.distributed.fsdp.FSDPModule``, or None where torch has no distributed."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return None
    return FSDPModule


def fsdp_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The FSDP2 units under ``model`` (itself included, as ``""``), in pre-order."""
    fsdp = fsdp_module_type()
    if fsdp is None:
        return []
    return [(path, m) for path, m in model.named_modules() if isinstance(m, fsdp)]


class UnsupportedFSDP(ValueError):
    """An FSDP2 setup amp_graph cannot capture; the capture raises it as a CaptureError."""


def _check_supported(path: str, module: nn.Module) -> Any:
    """The unit's FSDPState, or an error saying what amp_graph cannot capture and why."""
    state = module._get_fsdp_state()
    name = path or type(module).__name__
    if len(getattr(state, "_modules", (module,))) != 1:
        raise UnsupportedFSDP(
            f"amp_graph cannot capture the FSDP2 unit {name!r}: it was made by "
            "fully_shard([...]) over several modules, whose hooks fire per module; call "
            "fully_shard on each module (or on their common parent) instead."
        )
    policy = state._mp_policy
    if policy.param_dtype is not None or policy.output_dtype is not None:
        raise UnsupportedFSDP(
            f"the FSDP2 unit {name!r} has MixedPrecisionPolicy(param_dtype="
            f"{policy.param_dtype}, output_dtype={policy.output_dtype}): amp_graph casts each "
            "op's inputs itself, so leave param_dtype and output_dtype unset (keep "
            "reduce_dtype if you like) and pass the low dtype to amp_graph.compile or "
            "Graph.config.enable_amp."
        )
    return state


@contextlib.contextmanager
def _detached(hooks: dict[int, Any], hook_id: int) -> Iterator[None]:
    """Take one hook out of a module's hook dict; put it back at the same place after."""
    order = list(hooks)
    hook = hooks.pop(hook_id)
    try:
        yield
    finally:
        current = dict(hooks)
        current[hook_id] = hook
        hooks.clear()  # the same dict object: removable handles keep a reference to it
        hooks.update({k: current.pop(k) for k in order if k in current})
        hooks.update(current)  # hooks registered meanwhile, after, as registered


@contextlib.contextmanager
def fsdp_units_unsharded(model: nn.Module) -> Iterator[list[str]]:
    """Within: every FSDP2 unit of ``model`` unsharded, its forward hooks detached. Yields the
    units' paths (empty for a model without FSDP2, for which this does nothing)."""
    units = fsdp_units(model)
    states = [_check_supported(path, module) for path, module in units]
    with contextlib.ExitStack() as stack:
        for (_, module), state in zip(units, states, strict=True):
            pre, post = state._pre_forward_hook_handle.id, state._post_forward_hook_handle.id
            stack.enter_context(_detached(module._forward_pre_hooks, pre))
            stack.enter_context(_detached(module._forward_hooks, post))
        for _, module in units:
            stack.callback(module.reshard)  # runs before the hooks come back
            module.unshard()
        yield [path for path, _ in units]


__all__ = ["UnsupportedFSDP", "fsdp_module_type", "fsdp_units", "fsdp_units_unsharded"]
