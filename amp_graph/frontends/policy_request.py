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
  (dynamo may split a model over graphs). A module type or op override that matches
  nothing in the model a policy is applied to warns instead
  (:func:`check_module_type_overrides`, :func:`warn_unmatched_op_overrides`): a policy, as
  its op tables, may serve several models. A module type of the model's class name that is
  another class object raises;
* :func:`warn_node_overrides_without_effect`: a node override on a node that reads nothing
  a policy casts (integers, float64) is accepted, and changes nothing: a warning says so.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from amp_graph.frontends.user_frames import users_stacklevel
from amp_graph.passes.classify import op_facts, uncast_reads
from amp_graph.passes.meta import LOW_PRECISION
from amp_graph.policy import PRESETS, Policy, base_name, nearest, op_key_name, resolve_policy


@dataclass(frozen=True)
class AmpRequest:
    """A resolved request: the policy object, the low dtype it computes in, the device type."""

    policy: Policy
    dtype: torch.dtype
    device_type: str


def default_dtype(device_type: str) -> torch.dtype:
    """torch.autocast's default: float16 on CUDA, bfloat16 on CPU."""
    return torch.float16 if device_type == "cuda" else torch.bfloat16


def check_dtype(dtype: Any, policy: Policy | None = None) -> torch.dtype:
    """``dtype`` if it is a low-precision compute dtype; a ValueError saying what to pass
    else (for ``policy``, where given: O0 with overrides needs a low dtype for them)."""
    if dtype in LOW_PRECISION:
        return dtype
    hint = ""
    if dtype == torch.float32 and policy is not None and policy.casts_nothing:
        hint = (
            " A policy that casts nothing (O0) computes in float32 already; its overrides "
            "compute in dtype, so pass torch.float16 or torch.bfloat16 (or leave dtype out "
            "for the device's default)."
        )
    elif dtype == torch.float32:
        hint = " For float32 everywhere use policy='O0'."
    elif isinstance(dtype, str):
        name = "bfloat16" if "b" in dtype else "float16"
        hint = f" Pass the torch dtype object, e.g. dtype=torch.{name}."
    raise ValueError(
        "dtype is the low-precision compute dtype, torch.float16 or torch.bfloat16; "
        f"got {dtype!r}.{hint}"
    )


def float32_for_o0(policy: Policy, dtype: Any) -> bool:
    """``dtype=torch.float32`` with a policy that changes nothing (O0): what it computes in
    anyway, so accepted; the plan then takes the device's default low dtype, which no op
    uses (the model's own autocast blocks keep their dtype)."""
    return dtype == torch.float32 and policy.changes_nothing


def check_request(policy: Policy | str, dtype: Any) -> None:
    """Raise for a policy or dtype that no model could make valid: a policy of the wrong type,
    a dtype's name as the policy (saying that dtype is its own argument), an unknown preset
    (naming the nearest), a dtype that is not a low float (float32 is accepted with O0, which
    computes in it), a dtype fp8 cannot compute around."""
    if not isinstance(policy, (Policy, str)):
        raise TypeError(
            f"policy is a preset name {list(PRESETS)} or an amp_graph.Policy; "
            f"got {policy!r} of type {type(policy).__name__}"
        )
    # an unknown preset fails here, a dtype's name too (Policy.preset says where it goes)
    resolved = resolve_policy(policy, "cpu")
    if dtype is None or float32_for_o0(resolved, dtype):
        return
    if resolved.fp8 is not None:
        from amp_graph.policy.fp8_recipe import check_fp8_low_dtype

        check_fp8_low_dtype(dtype)
    else:
        check_dtype(dtype, resolved)


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
    if dtype is None or float32_for_o0(policy, dtype):
        return default_dtype(device_type)
    return check_dtype(dtype, policy)


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


def check_module_type_overrides(policy: Policy, modules: Iterable[nn.Module]) -> None:
    """For each ``module_types`` key no module of ``modules`` is an instance of (the policy
    matches a type and its subclasses): a ValueError where the model has a class of that
    name, another class object (the same class imported twice, a copy of a library: the
    override surely meant it), else a UserWarning naming the nearest class. A policy may
    serve several models, as its tables do, so a type one model lacks is no error."""
    present = list(dict.fromkeys(type(m) for m in modules))
    for key in policy.module_types:
        if any(issubclass(cls, key) for cls in present):
            continue
        said = f"module type override {_qualified(key)} matches no module of the model."
        twin = next((c for c in present if c.__qualname__ == key.__qualname__), None)
        if twin is not None:
            raise ValueError(
                f"{said} The model's {twin.__qualname__} is a different class object: "
                f"{_qualified(twin)} (id {id(twin):#x}), where the override names "
                f"{_qualified(key)} (id {id(key):#x}); pass the model's own class "
                f"(type(module) of one of its {twin.__qualname__} modules)."
            )
        hint = nearest(key.__qualname__, [c.__qualname__ for c in present])
        _warn(f"{said}{hint} It changes nothing here.")


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _warn(message: str) -> None:
    """A UserWarning pointing at the user's line: a setting that changes nothing."""
    warnings.warn(f"amp_graph: {message}", UserWarning, stacklevel=users_stacklevel())


def warn_unmatched_op_overrides(policy: Policy, gm: fx.GraphModule) -> None:
    """A UserWarning for each op override that matches no op of the captured ``gm``, naming
    the nearest of its ops: ``"_softmax"`` (the op a profiler shows, where the graph calls
    ``softmax``), ``"conv2d"`` in a model without convolutions. Matched as the policy
    matches (its own lookup, one override at a time). A warning, not an error: a policy
    may serve several models, as its op tables do."""
    if not policy.ops:
        return
    known: dict[str, type] = {}
    facts = [op_facts(n, gm, known) for n in gm.graph.nodes if n.op == "call_function"]
    for key, rule in policy.ops.items():
        probe = Policy("probe", ops={key: rule})
        if any(probe.decide(f).source == "op override" for f in facts):
            continue
        names = sorted({base_name(f.aten[0]) for f in facts if f.aten})
        _warn(
            f"op override {op_key_name(key)!r} matches no op of the captured graph, so it "
            f"changes nothing here.{nearest(_bare_name(key), names)} The graph's ops are "
            "aten ops (amp_graph.report(compiled) lists them)."
        )


def _bare_name(key: Any) -> str:
    """An op key as the graph's aten ops are named, to find the nearest: ``"aten::mm.out"``
    -> ``"mm"``, ``torch.ops.aten.softmax.int`` -> ``"softmax"``, ``nn.Conv2d`` ->
    ``"conv2d"``."""
    if isinstance(key, str):
        return base_name(key.split("::")[-1])
    name = op_key_name(key)
    if name.startswith("aten."):
        return base_name(name.removeprefix("aten."))
    return name.rsplit(".", 1)[-1].lower()


def warn_node_overrides_without_effect(policy: Policy, gm: fx.GraphModule) -> None:
    """Warn once per planned ``gm`` for each node override on a node that reads nothing a
    policy casts (:func:`amp_graph.passes.classify.uncast_reads`): accepted, it changes
    nothing."""
    for node in gm.graph.nodes:
        if node.name not in policy.nodes or (reads := uncast_reads(node)) is None:
            continue
        what = ", ".join(dict.fromkeys(str(d).replace("torch.", "") for d in reads))
        _warn(
            f"node override {node.name!r} -> {policy.nodes[node.name]} has no effect: "
            f"{node.name!r} reads no floating-point value a policy casts (it reads "
            f"{what or 'no tensor'}; only float16, bfloat16 and float32 are cast). Cast its "
            "inputs in the model to change its dtype."
        )


__all__ = [
    "AmpRequest",
    "check_dtype",
    "check_module_type_overrides",
    "check_request",
    "default_dtype",
    "device_type_of",
    "float32_for_o0",
    "resolve",
    "resolve_dtype",
    "validate_module_overrides",
    "validate_node_overrides",
    "warn_node_overrides_without_effect",
    "warn_unmatched_op_overrides",
]
