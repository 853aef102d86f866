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

FSDP's own mixed precision (``MixedPrecisionPolicy``) is honoured. ``param_dtype``: the
units are unsharded for the capture as FSDP unshards them, so the graph reads (and the
passes plan for) parameters in that dtype, all-gathered at half the bytes; ops the policy
computes in float32 read them upcast. ``cast_forward_inputs`` and ``output_dtype``: while
the hooks are detached, stand-ins at their places in the hook dicts cast the unit's inputs
and outputs as FSDP's hooks do, so the capture records those casts and every dtype the
passes plan is the one the hooks will deliver (where the graph runs the recorded cast
after FSDP's own, it is a no-op or an identical copy). ``reduce_dtype`` is the gradient
reduce-scatter's and touches no value of the graph. :func:`mixed_precision` describes
each unit's policy for :func:`amp_graph.report`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from amp_graph.passes.meta import FSDP_MIXED_PRECISION, short


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
    return state


def _cast_floating(value: Any, dtype: torch.dtype | None) -> Any:
    """FSDP's cast of a hook's inputs or outputs: floating tensors of another dtype."""
    if dtype is None:
        return value

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return pytree.tree_map(cast, value)


def _stand_ins(state: Any) -> tuple[Callable, Callable]:
    """The casts FSDP's pre- and post-forward hooks make (``cast_forward_inputs`` with
    ``param_dtype``, ``output_dtype``), as hooks of the same signatures."""
    policy = state._mp_policy
    inputs = policy.param_dtype if policy.cast_forward_inputs else None

    def pre(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return _cast_floating(args, inputs), _cast_floating(kwargs, inputs)

    def post(module: nn.Module, args: tuple, output: Any) -> Any:
        return _cast_floating(output, policy.output_dtype)

    return pre, post


def owning_units(
    units: Iterable[tuple[str, nn.Module]], *, remove_duplicate: bool = True
) -> dict[str, str]:
    """Parameter name -> the path of the innermost of ``units`` holding it, the unit FSDP2
    shards it in. ``units``: (path, module) in pre-order, as ``named_modules`` yields them;
    ``remove_duplicate=False`` names a tied parameter under each of its names."""
    owners: dict[str, str] = {}
    for path, module in units:  # pre-order: inner units overwrite outer ones
        prefix = f"{path}." if path else ""
        for name, _ in module.named_parameters(remove_duplicate=remove_duplicate):
            owners[prefix + name] = path
    return owners


def _per_parameter(model: nn.Module, of_unit: Callable[[nn.Module], Any]) -> dict[str, Any]:
    """Floating parameter name -> ``of_unit(unit)`` for the innermost FSDP2 unit owning it
    (the one that shards it), where that is not None."""
    units = fsdp_units(model)
    values = {path: of_unit(module) for path, module in units}
    return {
        name: values[path]
        for name, path in owning_units(units).items()
        if values[path] is not None and model.get_parameter(name).is_floating_point()
    }


def gathered_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    """Parameter name -> the dtype its FSDP2 unit all-gathers it in, for the floating
    parameters of units whose ``MixedPrecisionPolicy`` sets ``param_dtype``."""
    return _per_parameter(model, lambda unit: unit._get_fsdp_state()._mp_policy.param_dtype)


PLANNED_FOR = "_amp_graph_fsdp_plan"
"""Attribute ``amp_graph.FSDPPlan.fully_shard`` sets on each unit it gives the low
all-gather: the policy and dtype it planned for (``"O1, bf16"``)."""


def planned_for(model: nn.Module) -> dict[str, str]:
    """Parameter name -> what :data:`PLANNED_FOR` says, for the parameters of the units that
    ``plan_fsdp`` gave the low all-gather."""
    return _per_parameter(model, lambda unit: unit.__dict__.get(PLANNED_FOR))


def mixed_precision(model: nn.Module) -> dict[str, str]:
    """Per FSDP2 unit with a ``MixedPrecisionPolicy`` that changes anything, what it does."""
    described = {}
    for path, module in fsdp_units(model):
        policy = module._get_fsdp_state()._mp_policy
        parts = [
            f"{field}={short(getattr(policy, field))}"
            for field in ("param_dtype", "reduce_dtype", "output_dtype")
            if getattr(policy, field) is not None
        ]
        if parts:
            if policy.param_dtype is not None and policy.cast_forward_inputs:
                parts.append("cast_forward_inputs")
            described[path or "<root>"] = ", ".join(parts)
    return described


@contextlib.contextmanager
def _detached(hooks: dict[int, Any], hook_id: int, stand_in: Callable) -> Iterator[None]:
    """Put ``stand_in`` in the place of one hook of a module's hook dict; put the hook back
    at the same place after."""
    order = list(hooks)
    hook = hooks[hook_id]
    hooks[hook_id] = stand_in
    try:
        yield
    finally:
        current = dict(hooks)
        current[hook_id] = hook
        hooks.clear()  # the same dict object: removable handles keep a reference to it
        hooks.update({k: current.pop(k) for k in order if k in current})
        hooks.update(current)  # hooks registered meanwhile, after, as registered


def _check_inputs_reach_low_units(units: list[tuple[str, nn.Module]], states: list) -> None:
    """Under a policy that casts nothing (O0), a unit that all-gathers its parameters in a
    low dtype and leaves its inputs as they come (``cast_forward_inputs=False``, as
    ``plan_fsdp`` shards) would meet float32 inputs with low weights: torch's "mat1 and
    mat2 must have the same dtype" at the first matmul. Say which units, and the ways out."""
    uncast = [
        (path or "<root>", state._mp_policy.param_dtype)
        for (path, _), state in zip(units, states, strict=True)
        if state._mp_policy.param_dtype not in (None, torch.float32)
        and not state._mp_policy.cast_forward_inputs
    ]
    if uncast:
        names = ", ".join(repr(path) for path, _ in uncast[:4]) + (", ..." if uncast[4:] else "")
        raise UnsupportedFSDP(
            f"the policy casts nothing (O0), but the FSDP2 units {names} all-gather their "
            f"parameters in {short(uncast[0][1])} with cast_forward_inputs=False (as "
            "amp_graph.plan_fsdp shards for a policy that computes in the low dtype), so "
            "their float32 inputs would meet low-precision weights. Compile with the policy "
            "the units were planned for (O1, say), or shard them with MixedPrecisionPolicy() "
            "(float32 all-gathers) or with cast_forward_inputs=True."
        )


@contextlib.contextmanager
def fsdp_units_unsharded(model: nn.Module, casts_nothing: bool = False) -> Iterator[list[str]]:
    """Within: every FSDP2 unit of ``model`` unsharded, its forward hooks detached (stand-ins
    making their casts in their places). Yields the units' paths (empty for a model without
    FSDP2, for which this does nothing). ``casts_nothing``: the capture's policy casts no
    op (O0), so a unit gathering low must cast its own inputs."""
    units = fsdp_units(model)
    states = [_check_supported(path, module) for path, module in units]
    if casts_nothing:
        _check_inputs_reach_low_units(units, states)
    with contextlib.ExitStack() as stack:
        for (_, module), state in zip(units, states, strict=True):
            pre, post = state._pre_forward_hook_handle.id, state._post_forward_hook_handle.id
            cast_inputs, cast_outputs = _stand_ins(state)
            stack.enter_context(_detached(module._forward_pre_hooks, pre, cast_inputs))
            stack.enter_context(_detached(module._forward_hooks, post, cast_outputs))
        for _, module in units:
            stack.callback(module.reshard)  # runs before the hooks come back
            module.unshard()
        yield [path for path, _ in units]


__all__ = [
    "FSDP_MIXED_PRECISION",
    "PLANNED_FOR",
    "UnsupportedFSDP",
    "fsdp_module_type",
    "fsdp_units",
    "fsdp_units_unsharded",
    "gathered_dtypes",
    "mixed_precision",
    "owning_units",
    "planned_for",
]
