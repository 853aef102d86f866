"""FSDP2 mixed precision planned from the AMP plan, before the model is sharded.

FSDP2 all-gathers each unit's parameters in one dtype, the unit's
``MixedPrecisionPolicy.param_dtype``, fixed when ``fully_shard`` is called. A unit whose every
parameter the graph reads only through a cast to the low dtype can be all-gathered in that
dtype: each op then reads the same values (the cast moves from after the all-gather to
before it, where it rounds the shard the same way), at half the bytes on the wire and in the
unsharded copy. Which units qualify follows from the policy, so :func:`plan_fsdp` captures
the model once, unsharded, runs the passes, and gives each unit its policy:

* read only low: ``MixedPrecisionPolicy(param_dtype=low, reduce_dtype=float32,
  cast_forward_inputs=False)``. Gradients are reduce-scattered in float32 (as without a
  policy: bit for bit), and the unit's inputs are left as they are, since the graph casts
  what it casts itself.
* any parameter read otherwise (a norm's weight read in float32, a parameter pinned by
  ``overrides``, an fp8 linear's weight, whose scale is taken on the float32 values): the
  unit keeps ``MixedPrecisionPolicy()`` and is all-gathered in float32, because FSDP2's
  policy is per unit and a low all-gather would round those parameters. The plan names them
  and the child modules that would all-gather low as units of their own
  (:attr:`FSDPPlan.split`); planning again with those added as units gives them the low
  all-gather while the parent keeps its norms exact.

A model built on the meta device, as FSDP2 builds one larger than a rank's memory, is
planned on a copy whose tensors are fake, on the device it will compute on: no memory.

amp_graph never changes the policy of a unit already sharded (FSDP2 fixes its buffers at the
first all-gather); the plan is applied by ``fully_shard`` (:meth:`FSDPPlan.fully_shard`). A
model sharded so runs through :func:`amp_graph.compile` or ``Graph``, which honour the
policy; called eagerly, it needs ``torch.autocast`` (its low units hold low parameters and
do not cast inputs).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from amp_graph.capture.fsdp_units import PLANNED_FOR, fsdp_module_type, owning_units
from amp_graph.frontends.compiler import compile as amp_compile
from amp_graph.frontends.compiler import compile_record
from amp_graph.passes.meta import AMP, Role, short
from amp_graph.policy import Policy


def read_only_low(node: fx.Node, low: torch.dtype) -> bool:
    """Whether the ``get_attr`` ``node`` is read, and every op reading it reads it through
    a cast to ``low``: then an attribute arriving in ``low`` gives each op the same value."""
    return bool(node.users) and all(
        user.meta[AMP].role is Role.CAST and len(user.args) > 1 and user.args[1] == low
        for user in node.users
    )


def parameters_read_low(gm: fx.GraphModule, low: torch.dtype) -> dict[int, bool]:
    """``id`` of each parameter the graph reads -> :func:`read_only_low` over all its reads
    (keyed by tensor, so that tied parameters' names agree)."""
    reads: dict[int, bool] = {}
    for node in gm.graph.nodes:
        parameter = _parameter(gm, node.target) if node.op == "get_attr" else None
        if parameter is not None and node.users:
            key = id(parameter)
            reads[key] = reads.get(key, True) and read_only_low(node, low)
    return reads


def _parameter(gm: fx.GraphModule, target: str) -> nn.Parameter | None:
    try:
        return gm.get_parameter(target)
    except AttributeError:  # a buffer or a constant
        return None


@dataclass(frozen=True)
class UnitPlan:
    """One FSDP2 unit's part of the plan."""

    path: str
    policy: Any  # torch.distributed.fsdp.MixedPrecisionPolicy
    parameters: int  # floating parameters the unit owns (nested units' excluded)
    full_bytes: int  # their all-gather output's bytes in their own dtype (float32)
    gathered_bytes: int  # and in the planned param_dtype
    read_exact: list[str] = field(default_factory=list)  # why the unit stays float32


@dataclass
class FSDPPlan:
    """Per FSDP2 unit, the ``MixedPrecisionPolicy`` the AMP plan permits (:func:`plan_fsdp`).

    ``plan[unit]`` (a module or its path; ``""`` the root) is the policy to pass to
    ``fully_shard``; :meth:`fully_shard` shards the model so. ``split``: per unit that
    keeps float32 for some parameters, the child modules that would all-gather low as units
    of their own."""

    model: nn.Module
    policy: str  # the policy's name, as the plan was made for it
    dtype: torch.dtype
    units: dict[str, UnitPlan]
    split: dict[str, list[str]]

    def __getitem__(self, unit: nn.Module | str) -> Any:
        return self.units[self._path(unit)].policy

    def _path(self, unit: nn.Module | str) -> str:
        path = unit if isinstance(unit, str) else _module_path(self.model, unit)
        if path not in self.units:
            raise KeyError(f"{path or '<root>'!r} is not a unit of this plan: {list(self.units)}")
        return path

    @property
    def all_gather_ratio(self) -> float:
        """All-gather bytes per forward with the plan / with every unit in float32."""
        full = sum(u.full_bytes for u in self.units.values())
        return sum(u.gathered_bytes for u in self.units.values()) / full if full else 1.0

    def fully_shard(self, **fully_shard_kwargs: Any) -> nn.Module:
        """``fully_shard`` each unit with its planned policy, innermost first, the root last
        (FSDP2's order); the other arguments (``mesh``, ``reshard_after_forward``...) go to
        every call. Each unit given the low all-gather is marked with what it was planned for,
        so that a compile under another policy that reads its parameters wider warns.
        Returns the model."""
        if "mp_policy" in fully_shard_kwargs:
            raise ValueError(
                "FSDPPlan.fully_shard sets each unit's mp_policy from the plan; to give your "
                "own, call fully_shard(unit, mp_policy=...) yourself"
            )
        from torch.distributed.fsdp import fully_shard

        for path in sorted(self.units, key=lambda p: -p.count(".") - bool(p)):
            unit = self.model.get_submodule(path)
            fully_shard(unit, mp_policy=self[path], **fully_shard_kwargs)
            if self[path].param_dtype is not None:
                unit.__dict__[PLANNED_FOR] = f"{self.policy}, {short(self.dtype)}"
        return self.model

    def __str__(self) -> str:
        low = short(self.dtype)
        lines = [f"FSDP2 plan ({low}): all-gather {self.all_gather_ratio:.2f}x float32"]
        for unit in self.units.values():
            if not unit.parameters:
                lines.append(f"  {unit.path or '<root>'}: no parameters of its own")
                continue
            gathered = short(unit.policy.param_dtype or torch.float32)
            line = (
                f"  {unit.path or '<root>'}: {unit.parameters} "
                f"parameter{'s' if unit.parameters > 1 else ''}, all-gather "
                f"{gathered} ({unit.gathered_bytes:,} of {unit.full_bytes:,} bytes)"
            )
            if unit.read_exact:
                line += f"; read in float32: {', '.join(unit.read_exact)}"
            if self.split.get(unit.path):
                children = ", ".join(self.split[unit.path])
                line += f"; {low} as units of their own (split_mixed=True): {children}"
            lines.append(line)
        return "\n".join(lines)


def _not_a_submodule(module: nn.Module) -> ValueError:
    return ValueError(
        f"the unit {type(module).__name__} is not a submodule of the model; give modules "
        "of the model being planned (or their paths, '' for the model itself)"
    )


def _module_path(model: nn.Module, module: nn.Module) -> str:
    for path, candidate in model.named_modules():
        if candidate is module:
            return path
    raise _not_a_submodule(module)


def _unit_paths(model: nn.Module, units: Iterable[nn.Module | str]) -> list[str]:
    named = list(model.named_modules())  # one walk for every unit given as a module
    path_of: dict[int, str] = {}
    for path, module in named:
        path_of.setdefault(id(module), path)
    paths = []
    for unit in units:
        if isinstance(unit, str):
            try:
                model.get_submodule(unit)
            except AttributeError as error:
                raise ValueError(f"plan_fsdp: no submodule {unit!r} in the model") from error
            paths.append(unit)
        elif isinstance(unit, nn.Module):
            if id(unit) not in path_of:
                raise _not_a_submodule(unit)
            paths.append(path_of[id(unit)])
        else:
            raise TypeError(
                f"plan_fsdp: units are modules or their paths; got {type(unit).__name__}"
            )
    if not paths:
        raise ValueError("plan_fsdp: no units given (the modules you will fully_shard)")
    order = {path: i for i, (path, _) in enumerate(named)}
    # the model's order, as FSDP2 runs them (a module shared under two names: last)
    return sorted(set(paths), key=lambda path: order.get(path, len(order)))


def _owners(model: nn.Module, units: Sequence[str]) -> dict[str, str]:
    """Parameter name (each name of a tied one) -> the innermost of ``units`` (paths, in
    the model's order) holding it."""
    modules = [(path, model.get_submodule(path)) for path in units]
    return owning_units(modules, remove_duplicate=False)


def _check_ties_within_units(model: nn.Module, units: Sequence[str]) -> None:
    """A parameter tied under names in two units would be sharded by each (FSDP2 replaces
    a module's parameter with its shard, which unties it): refuse such units."""
    seen: dict[int, tuple[str, str | None]] = {}
    owners = _owners(model, units)
    for name, param in model.named_parameters(remove_duplicate=False):
        owner = owners.get(name)
        first = seen.setdefault(id(param), (name, owner))
        if first[1] != owner:
            where = [u or "<root>" for u in (first[1], owner)]
            raise ValueError(
                f"the tied parameters {first[0]!r} and {name!r} fall in different units "
                f"({where[0]!r}, {where[1]!r}); FSDP2 shards each unit's parameters "
                "separately, which would untie them. Put the modules sharing a parameter "
                "in one unit (for a tied head: leave it to the root)"
            )


def _splits(
    model: nn.Module, unit: str, units: Sequence[str], owned: Mapping[str, bool | None]
) -> list[str]:
    """The largest child modules of ``unit`` (not units themselves) whose every parameter
    read is read only low; ``owned``: the unit's parameters -> read only low (None: unread)."""
    found: list[str] = []
    names: dict[int, list[str]] = {}  # a tied parameter's every name
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)

    def holds_its_ties(child: nn.Module, path: str) -> bool:
        return all(n.startswith(path + ".") for p in child.parameters() for n in names[id(p)])

    def visit(path: str) -> None:
        for child, module in model.get_submodule(path).named_children():
            child_path = f"{path}.{child}" if path else child
            if child_path in units:
                continue
            read = [
                low
                for name, low in owned.items()
                if low is not None and name.startswith(child_path + ".")
            ]
            if read and all(read) and holds_its_ties(module, child_path):
                found.append(child_path)
            elif read:
                visit(child_path)

    visit(unit)
    return found


def _on_compute_device(
    model: nn.Module, inputs: Sequence[Any], kwargs: dict[str, Any] | None, device: Any
) -> tuple[nn.Module, Sequence[Any], dict[str, Any] | None]:
    """The model and inputs to capture: themselves, or for a model on the meta device a copy
    with fake tensors on ``device``. (Meta tensors have no autocast, and the capture relies on
    it where a composite op checks its inputs' dtypes before any kernel runs: SDPA.)"""
    tensors = [*model.parameters(), *model.buffers()]
    if not any(t.is_meta for t in tensors):
        if device is not None:
            raise ValueError(
                "plan_fsdp's device= is for a model on the meta device; this one is on "
                f"{tensors[0].device if tensors else 'no device'}, where it is planned"
            )
        return model, inputs, kwargs
    from torch._subclasses.fake_tensor import FakeTensorMode

    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "plan_fsdp(device='cuda') plans under CUDA's autocast, which needs CUDA; plan on "
            "'cpu' here: O1, O2, O3 and fp8 decide every op as on CUDA (a CPU without a "
            "low-precision kernel for an op keeps its parameters float32: a safe plan), "
            "'autocast' uses the planning device's autocast lists"
        )

    def fake(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=target)

    traced = copy.deepcopy(model)  # meta: no memory
    with FakeTensorMode(allow_non_fake_inputs=True):
        traced.to_empty(device=target)
        inputs, kwargs = pytree.tree_map(fake, (tuple(inputs), kwargs))
    return traced, inputs, kwargs


def plan_fsdp(
    model: nn.Module,
    units: Iterable[nn.Module | str],
    policy: Policy | str = "O1",
    dtype: torch.dtype | None = None,
    *,
    example_inputs: Sequence[Any],
    example_kwargs: dict[str, Any] | None = None,
    device: str | torch.device | None = None,
    split_mixed: bool = False,
) -> FSDPPlan:
    """Per FSDP2 unit, the ``MixedPrecisionPolicy`` that ``policy`` permits: the low
    all-gather for units whose every parameter the graph reads only in ``dtype``.

    Call it on the model before ``fully_shard`` (it captures the model, unsharded, as
    :func:`amp_graph.compile` does, from fake tensors), then shard with the plan:

    >>> plan = amp_graph.plan_fsdp(model, [*model.layers, model], "O1",
    ...                            example_inputs=(tokens,))          # doctest: +SKIP
    >>> print(plan); plan.fully_shard()                               # doctest: +SKIP
    >>> compiled = amp_graph.compile(model, "O1")                     # doctest: +SKIP

    Args:
        model: the model, not yet sharded.
        units: the modules you will ``fully_shard`` (or their paths; ``""`` or ``model``
            for the root). A parameter belongs to the innermost unit holding it, as in FSDP2.
        policy, dtype, example_inputs, example_kwargs: as :func:`amp_graph.compile`; compile
            the sharded model with the same policy and dtype.
        device: for a model built on the meta device (FSDP2's recipe for a model larger
            than one rank's memory), the device it will compute on (by default CUDA where
            there is one, else the CPU): the plan is made on a copy whose parameters and
            inputs are fake tensors there, so nothing is allocated. Meta example inputs are
            fine. Other models are planned on their own device.
        split_mixed: also make units of the children that :attr:`FSDPPlan.split` names
            (the largest submodules of a unit kept float32 whose every parameter read is
            low), so that they gather low while their parent keeps the rest exact: a Llama
            layer's attention and MLP, around its norms. More, smaller all-gathers.

    Returns:
        An :class:`FSDPPlan`; ``print`` it for the bytes and the reasons.
    """
    fsdp = fsdp_module_type()
    if fsdp is not None and any(isinstance(m, fsdp) for m in model.modules()):
        raise ValueError(
            "plan_fsdp plans a model before fully_shard; this one is already sharded (FSDP2 "
            "fixes a unit's param_dtype when it shards it). Plan the unsharded model, then "
            "shard it with plan.fully_shard() or fully_shard(unit, mp_policy=plan[unit])"
        )
    paths = _unit_paths(model, units)
    _check_ties_within_units(model, paths)
    traced, inputs, kwargs = _on_compute_device(model, example_inputs, example_kwargs, device)
    compiled = amp_compile(traced, policy, dtype, example_inputs=inputs, example_kwargs=kwargs)
    gm = compiled.graph_module
    record = compile_record(gm)
    low = record.dtype
    read = parameters_read_low(gm, low)
    low_only: dict[str, bool | None] = {  # the copy's names are the model's
        name: read.get(id(p)) for name, p in traced.named_parameters() if p.is_floating_point()
    }
    planned, split = _plan_units(model, paths, low_only, low)
    if split_mixed and split:  # the children are read only low: one more round settles it
        paths = _unit_paths(model, [*paths, *(p for children in split.values() for p in children)])
        planned, split = _plan_units(model, paths, low_only, low)
    return FSDPPlan(model=model, policy=record.policy.name, dtype=low, units=planned, split=split)


def _plan_units(
    model: nn.Module, paths: Sequence[str], low_only: Mapping[str, bool | None], low: torch.dtype
) -> tuple[dict[str, UnitPlan], dict[str, list[str]]]:
    """Each unit's plan, and per unit kept float32 the children that would gather low."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    owners = _owners(model, paths)
    planned: dict[str, UnitPlan] = {}
    split = {}
    for unit in paths:
        owned = {n: v for n, v in low_only.items() if owners.get(n) == unit}
        exact = [n for n, v in owned.items() if v is False]
        tensors = [model.get_parameter(n) for n in owned]
        full = sum(p.numel() * p.element_size() for p in tensors)
        gather_low = bool(owned) and not exact
        planned[unit] = UnitPlan(
            path=unit,
            policy=(
                MixedPrecisionPolicy(
                    param_dtype=low, reduce_dtype=torch.float32, cast_forward_inputs=False
                )
                if gather_low
                else MixedPrecisionPolicy()
            ),
            parameters=len(owned),
            full_bytes=full,
            gathered_bytes=sum(p.numel() for p in tensors) * low.itemsize if gather_low else full,
            read_exact=[n.removeprefix(f"{unit}.") if unit else n for n in exact],
        )
        children = _splits(model, unit, paths, owned) if exact else []
        if children:
            split[unit] = children
    return planned, split


__all__ = ["FSDPPlan", "UnitPlan", "parameters_read_low", "plan_fsdp", "read_only_low"]
