"""What a request means: the user's policy, dtype and model, checked and resolved.

These are the pieces; :func:`amp_graph.frontends.front_door.admit` runs them, in one order,
for every entry point (``compile``, ``compile_``, the backend, ``Graph``, ``export``,
``autopolicy``):

* :func:`check_request`: the checks that need no model, also run where the user states the
  request (``backend(...)``, ``graph.config.enable_amp(...)``), so a bad preset name, dtype
  or fp8 dtype fails at that line;
* :func:`device_type_of`: the device a model computes on, one rule for all;
* :func:`resolve`: policy object, low dtype and device type (:class:`AmpRequest`), with fp8's
  device check and the CPU's missing low-precision kernels;
* :func:`validate_module_overrides` and :func:`validate_node_overrides`: module paths and node
  names that match nothing raise ``ValueError`` naming the nearest. The paths are those of
  the module the entry point captures: the model's own ``named_modules()`` for ``compile``,
  the Graph's (``model.head`` for ``self.model``) for ``Graph``; the backend only warns
  (dynamo may split a model over graphs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from amp_graph.passes.meta import LOW_PRECISION
from amp_graph.policy import PRESETS, Policy, resolve_policy


@dataclass(frozen=True)
class AmpRequest:
    """A resolved request: the policy object, the low dtype it computes in, the device type."""

    policy: Policy
    dtype: torch.dtype
    device_type: str


def default_dtype(device_type: str) -> torch.dtype:
    """torch.autocast's default: float16 on CUDA, bfloat16 on CPU."""
    return torch.float16 if device_type == "cuda" else torch.bfloat16


def check_dtype(dtype: Any) -> torch.dtype:
    """``dtype`` if it is a low-precision compute dtype; a ValueError saying what to pass else."""
    if dtype in LOW_PRECISION:
        return dtype
    hint = ""
    if dtype == torch.float32:
        hint = " For float32 everywhere use policy='O0'."
    elif isinstance(dtype, str):
        name = "bfloat16" if "b" in dtype else "float16"
        hint = f" Pass the torch dtype object, e.g. dtype=torch.{name}."
    raise ValueError(
        "dtype is the low-precision compute dtype, torch.float16 or torch.bfloat16; "
        f"got {dtype!r}.{hint}"
    )


def check_request(policy: Policy | str, dtype: Any) -> None:
    """Raise for a policy or dtype that no model could make valid: a policy of the wrong type
    or an unknown preset (naming the nearest), a dtype that is not a low float, a dtype fp8
    cannot compute around."""
    if not isinstance(policy, (Policy, str)):
        raise TypeError(
            f"policy is a preset name {list(PRESETS)} or an amp_graph.Policy; "
            f"got {policy!r} of type {type(policy).__name__}"
        )
    resolved = resolve_policy(policy, "cpu")  # an unknown preset fails here
    if dtype is None:
        return
    if resolved.fp8 is not None:
        from amp_graph.policy.fp8_recipe import check_fp8_low_dtype

        check_fp8_low_dtype(dtype)
    else:
        check_dtype(dtype)


def resolve_dtype(policy: Policy, dtype: Any, device_type: str) -> torch.dtype:
    """The low dtype a policy computes in on a device, checked: torch.autocast's default
    (float16 on CUDA, else bfloat16), bfloat16 for fp8 policies, whose float8 matmuls
    this device must run (a clear error otherwise)."""
    if policy.fp8 is not None:
        from amp_graph.ops.fp8_ops import require_fp8_matmul
        from amp_graph.policy.fp8_recipe import check_fp8_low_dtype

        dtype = check_fp8_low_dtype(torch.bfloat16 if dtype is None else dtype)
        require_fp8_matmul(device_type, policy.fp8.recipe)
        return dtype
    return check_dtype(default_dtype(device_type) if dtype is None else dtype)


def device_type_of(module: nn.Module | None, inputs: Any = ()) -> str:
    """The device autocast would use: the first non-CPU device among the module's parameters
    and buffers, then the inputs' tensors; else ``"cpu"``. (A CPU buffer registered before
    CUDA parameters does not make a CUDA model a CPU one.)"""
    tensors: list[Any] = []
    if module is not None:
        tensors += [*module.parameters(), *module.buffers()]
    tensors += pytree.tree_leaves(inputs)
    for value in tensors:
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            return value.device.type
    return "cpu"


def resolve(policy: Policy | str, dtype: Any, device_type: str) -> AmpRequest:
    """The request as the passes take it (see the module doc). On the CPU, the policy also
    learns which ops this CPU cannot compute in the low dtype
    (:mod:`amp_graph.frontends.cpu_low_kernels`),
    so that a plan never asks for a kernel the machine lacks; an fp8 policy whose cost model
    is ``"measured"`` gets the device's (:func:`amp_graph.ops.fp8_speed.measured_fp8_cost`,
    measured once per device)."""
    resolved = resolve_policy(policy, device_type)
    low = resolve_dtype(resolved, dtype, device_type)
    if resolved.fp8 is not None and resolved.fp8.cost_model == "measured":
        from amp_graph.ops.fp8_speed import measured_fp8_cost

        measured = measured_fp8_cost(device_type, resolved.fp8.recipe)
        fp8 = dataclasses.replace(resolved.fp8, cost_model=measured)
        resolved = dataclasses.replace(resolved, fp8=fp8)
    if device_type == "cpu":
        from amp_graph.frontends.cpu_low_kernels import missing_low_kernels

        missing = missing_low_kernels(low)
        if missing:
            resolved = dataclasses.replace(resolved, missing_kernels=missing)
    return AmpRequest(resolved, low, device_type)


def validate_module_overrides(
    policy: Policy, module_paths: Iterable[str], *, where: str = "model"
) -> None:
    """Raise ValueError for a module path glob that matches none of ``module_paths`` (naming
    the nearest path and where paths start from), or globs that clash."""
    policy.validate_modules(module_paths, where=where)


def validate_node_overrides(policy: Policy, node_names: Iterable[str]) -> None:
    """Raise ValueError for a node override naming no node of the captured graph."""
    policy.validate_nodes(node_names)


__all__ = [
    "AmpRequest",
    "check_dtype",
    "check_request",
    "default_dtype",
    "device_type_of",
    "resolve",
    "resolve_dtype",
    "validate_module_overrides",
    "validate_node_overrides",
]
