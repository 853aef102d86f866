"""A :class:`Policy` as plain data (JSON), and back, for files others may read.

A repro bundle is made to be shared, and ``pickle`` runs whatever its file says. So a
bundle stores its policy with :func:`policy_as_data` (strings, numbers, lists and dicts) and
:func:`policy_from_data` rebuilds it without unpickling anything. References in a policy
are stored as names and looked up, never called:

* an aten op as ``"aten::softmax.int"`` (found in ``torch.ops``), a torch callable as
  ``"torch:nn.functional.softmax"`` (found under ``torch`` only);
* a module type as ``"package.module:Qualname"``: found among the modules the reading
  process has imported already, never imported (:mod:`amp_graph.policy.named_types`), and
  the name must be an ``nn.Module`` subclass.

A policy holding code (a key that is a user's function, an fp8 ``module_filter``) is not
data: :func:`policy_as_data` raises :class:`PolicyNotData` naming it.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from amp_graph.policy.fp8_cost import Fp8CostModel, GemmSpeed
from amp_graph.policy.fp8_recipe import Fp8Config
from amp_graph.policy.named_types import imported_type
from amp_graph.policy.precision_policy import Policy, Rule

FORMAT = 1
_SETS = ("allow", "deny", "promote", "follow")
_RULE_MAPS = ("modules", "nodes")
_TEXT_MAPS = ("notes", "missing_kernels")


class PolicyNotData(ValueError):
    """The policy holds code (a function), which plain data cannot hold."""


def policy_as_data(policy: Policy) -> dict[str, Any]:
    """``policy`` as JSON-able data. Raises :class:`PolicyNotData` naming what is code."""
    data: dict[str, Any] = {"format": FORMAT, "name": policy.name}
    for name in _SETS:
        data[name] = sorted(getattr(policy, name))
    data["default"] = policy.default.value
    data["cast_inputs"] = policy.cast_inputs
    data["master_weights"] = policy.master_weights
    data["recompute_casts"] = policy.recompute_casts
    data["place_casts"] = policy.place_casts
    data["cast_gradients_per_consumer"] = policy.cast_gradients_per_consumer
    data["output_dtype"] = None if policy.output_dtype is None else "float32"
    data["ops"] = {_key_name(key): rule.value for key, rule in policy.ops.items()}
    data["module_types"] = {_type_name(t): rule.value for t, rule in policy.module_types.items()}
    for name in _RULE_MAPS:
        data[name] = {k: rule.value for k, rule in getattr(policy, name).items()}
    for name in _TEXT_MAPS:
        data[name] = dict(getattr(policy, name))
    if policy.fp8 is not None:
        if policy.fp8.module_filter is not None:
            raise PolicyNotData(
                f"policy {policy.name!r} has an fp8 module_filter, a function: not data"
            )
        data["fp8"] = {
            "recipe": policy.fp8.recipe,
            "auto_filter": policy.fp8.auto_filter,
            "cost_model": _cost_model_data(policy.fp8.cost_model),
        }
    return data


def policy_from_data(data: Mapping[str, Any]) -> Policy:
    """The :class:`Policy` :func:`policy_as_data` stored. Raises ValueError on data it did
    not write (another format, an unknown field, a name that is not an op or module type)."""
    if data.get("format") != FORMAT:
        raise ValueError(f"not a policy amp_graph stored (format {data.get('format')!r})")
    known = {"format", "name", "default", "cast_inputs", "master_weights", "recompute_casts"}
    known |= {
        "place_casts",
        "cast_gradients_per_consumer",
        "output_dtype",
        "ops",
        "module_types",
        "fp8",
        *_SETS,
        *_RULE_MAPS,
        *_TEXT_MAPS,
    }
    if unknown := set(data) - known:
        raise ValueError(f"unknown policy fields {sorted(unknown)}")
    fp8 = data.get("fp8")
    return Policy(
        name=str(data["name"]),
        **{name: frozenset(map(str, data.get(name, ()))) for name in _SETS},
        default=Rule(data["default"]),
        cast_inputs=bool(data["cast_inputs"]),
        master_weights=bool(data["master_weights"]),
        recompute_casts=data["recompute_casts"],
        place_casts=bool(data.get("place_casts", False)),  # older data: the plan it had then
        cast_gradients_per_consumer=bool(data.get("cast_gradients_per_consumer", False)),
        output_dtype=_output_dtype(data.get("output_dtype")),  # older data: none
        ops={_key(name): Rule(rule) for name, rule in data.get("ops", {}).items()},
        module_types={_type(n): Rule(rule) for n, rule in data.get("module_types", {}).items()},
        **{
            name: {str(k): Rule(rule) for k, rule in data.get(name, {}).items()}
            for name in _RULE_MAPS
        },
        **{name: {str(k): str(v) for k, v in data.get(name, {}).items()} for name in _TEXT_MAPS},
        fp8=None
        if fp8 is None
        else Fp8Config(
            recipe=str(fp8["recipe"]),
            auto_filter=bool(fp8["auto_filter"]),
            cost_model=_cost_model_from(fp8.get("cost_model")),  # older data: none
        ),
    )


def _output_dtype(name: Any) -> torch.dtype | None:
    """``output_dtype`` as stored: None, or ``"float32"`` (the one dtype it takes)."""
    if name is None:
        return None
    if name != "float32":
        raise ValueError(f"policy output_dtype is null or 'float32'; got {name!r}")
    return torch.float32


def _cost_model_data(cost: Fp8CostModel | str | None) -> Any:
    """An fp8 cost model as data: None, ``"measured"``, or its figures."""
    if cost is None or isinstance(cost, str):
        return cost
    return {
        "bf16": [cost.bf16.fixed_ns, cost.bf16.flops_per_ns],
        "fp8": [cost.fp8.fixed_ns, cost.fp8.flops_per_ns],
        "quantize_bytes_per_ns": cost.quantize_bytes_per_ns,
        "device": cost.device,
        "margin": cost.margin,
    }


def _cost_model_from(data: Any) -> Fp8CostModel | str | None:
    if data is None or isinstance(data, str):
        return data
    return Fp8CostModel(
        GemmSpeed(*map(float, data["bf16"])),
        GemmSpeed(*map(float, data["fp8"])),
        float(data["quantize_bytes_per_ns"]),
        str(data["device"]),
        float(data["margin"]),
    )


def _key_name(key: Any) -> str:
    if isinstance(key, str):
        return key
    if isinstance(key, torch._ops.OpOverload):
        return f"{key._schema.name}.{key._overloadname}"
    if isinstance(key, torch._ops.OpOverloadPacket):
        return key._qualified_op_name
    if isinstance(key, type):
        return _type_name(key)
    module = getattr(key, "__module__", None) or ""
    qualname = getattr(key, "__qualname__", None) or getattr(key, "__name__", "")
    torch_name = _torch_path(key)
    if torch_name is not None:
        return f"torch:{torch_name}"
    raise PolicyNotData(
        f"the policy's op key {module}.{qualname} is a function of your own, not a torch op: "
        "a bundle stores its policy as data, so pass policy= to replay"
    )


def _torch_path(key: Any) -> str | None:
    """The attribute path under ``torch`` that gives ``key`` back, if there is one."""
    for prefix, root in (("Tensor.", torch.Tensor), ("nn.functional.", torch.nn.functional)):
        name = getattr(key, "__name__", None)
        if name and getattr(root, name, None) is key:
            return prefix + name
    name = getattr(key, "__name__", None)
    if name and getattr(torch, name, None) is key:
        return name
    return None


def _type_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _key(name: str) -> Any:
    if name.startswith("torch:"):
        return operator.attrgetter(name.removeprefix("torch:"))(torch)
    if ":" in name and "::" not in name:
        return _type(name)
    if "::" in name:
        namespace, _, rest = name.partition("::")
        op, _, overload = rest.partition(".")
        packet = getattr(getattr(torch.ops, namespace), op)
        return getattr(packet, overload) if overload else packet
    return name


def _type(name: str) -> type:
    return imported_type(name, nn.Module, "a module_types key of the policy")


__all__ = ["PolicyNotData", "policy_as_data", "policy_from_data"]
