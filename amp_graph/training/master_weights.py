"""Low-precision parameter storage with float32 master weights (policy O2 in a Graph).

The model keeps its parameters in the low-precision dtype (normalization layers excepted,
and those the plan reads only in float32: :mod:`amp_graph.passes.widen_parameters` finds
them, :meth:`release` gives them their float32 storage back);
the optimizers own float32 master copies. Gradients accumulate in float32 on the model's
parameters (``grad_dtype = torch.float32``: autograd casts each incoming low-precision
gradient before adding it, so micro-batches never accumulate in low precision); after
backward they are handed to the masters (no copy), the optimizer steps the masters, and the
masters are copied back with one foreach copy. On a torch without ``grad_dtype``, a
post-accumulate-grad hook moves each gradient onto its master (in float32) as backward
produces it. The masters are the truth: ``state_dict`` reports them, ``load_state_dict``
writes them and re-derives the low-precision copies, so the two never drift apart.

The user may still write the model's parameters between steps (``model.load_state_dict``, an
in-place re-initialization, ``param.data = value``, ``model.float()``), as in eager training:
each step records the version counters and storages of the copies it wrote, and before the
next step :meth:`MasterWeights.take_model_writes` gives the master of each copy written since
the value written (no per-element comparison to find them). A copy given new storage
(``.data =``, a dtype conversion) gets its own storage back, in the low dtype, so the step
graph and a captured CUDA graph keep reading one address. A parameter object replaced on its
module, or a module holding one replaced on its parent, is refused: its master belongs to the
old.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn

from amp_graph.policy.python_ops import NORMALIZATION_MODULES

log = logging.getLogger(__name__)

# Newer torch (2.13 has it): a leaf whose gradients have another dtype than the leaf.
HAS_GRAD_DTYPE = hasattr(torch.Tensor, "grad_dtype")

_VERSION = operator.attrgetter("_version")  # a tensor's count of in-place writes
_ADDRESS = torch.Tensor.data_ptr  # moves when ``.data =`` gives a tensor new storage

# where a module holds a parameter (qualified name, the module's _parameters, its key), or
# a parent one of the modules holding them (qualified name, the parent's _modules, its key)
Site = tuple[str, dict[str, Any], str]


class MasterWeights:
    """Pairs each low-precision model parameter with a float32 master parameter."""

    def __init__(
        self,
        pairs: list[tuple[str, nn.Parameter, nn.Parameter]],
        sites: Iterable[Site] = (),
        module_sites: Iterable[Site] = (),
    ) -> None:
        self.pairs = pairs  # (qualified name, model parameter (low), master parameter (fp32))
        self.sites = list(sites)  # where the modules hold the model parameters
        self.module_sites = list(module_sites)  # where their parents hold those modules
        self._hooks: dict[int, Any] = {}
        self._index()
        for _, model, master in pairs:
            if HAS_GRAD_DTYPE:
                model.grad_dtype = torch.float32
            elif model.requires_grad:
                hook = model.register_post_accumulate_grad_hook(_to_master_hook(master))
                self._hooks[id(model)] = hook

    def _index(self) -> None:
        self._by_model = {id(model): master for _, model, master in self.pairs}
        self._models = [model for _, model, _ in self.pairs]
        self._masters = [master for _, _, master in self.pairs]
        self.sites = [site for site in self.sites if id(site[1].get(site[2])) in self._by_model]
        self._site_dicts = [owner for _, owner, _ in self.sites]
        self._site_keys = [key for _, _, key in self.sites]
        self._site_params = [owner[key] for _, owner, key in self.sites]
        self.module_sites = [
            site
            for site in self.module_sites
            if any(id(p) in self._by_model for p in site[1][site[2]].parameters())
        ]
        self._module_dicts = [owner for _, owner, _ in self.module_sites]
        self._module_keys = [key for _, _, key in self.module_sites]
        self._module_objects = [owner[key] for _, owner, key in self.module_sites]
        self._storages = [model.data for model in self._models]  # (same storage, no copy)
        self._record()

    def _record(self) -> None:
        """Remember the version counters and addresses of the model's copies: they have the
        masters' values."""
        self._versions = list(map(_VERSION, self._models))
        self._addresses = list(map(_ADDRESS, self._models))

    @staticmethod
    def create(
        modules: dict[str, nn.Module],
        optimizers: Iterable[torch.optim.Optimizer],
        low_dtype: torch.dtype,
    ) -> MasterWeights:
        """Store the model's parameters in ``low_dtype`` (normalization layers stay fp32)
        and point the optimizers at float32 masters. Optimizer state moves with them."""
        keep: set[int] = set()
        pairs: list[tuple[str, nn.Parameter, nn.Parameter]] = []
        seen: set[int] = set()
        for prefix, root in modules.items():
            for module in root.modules():
                if isinstance(module, NORMALIZATION_MODULES):
                    keep.update(id(p) for p in module.parameters(recurse=False))
            for name, param in root.named_parameters():
                if id(param) in keep or id(param) in seen or param.dtype != torch.float32:
                    continue
                seen.add(id(param))
                master = nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)
                with torch.no_grad():
                    param.data = param.data.to(low_dtype)
                pairs.append((f"{prefix}.{name}", param, master))
        paired = {id(model) for _, model, _ in pairs}
        weights = MasterWeights(pairs, _sites(modules, paired), _module_sites(modules, paired))
        for optimizer in optimizers:
            _swap_in(optimizer, weights._by_model)
        return weights

    @torch.no_grad()
    def release(
        self, params: Iterable[nn.Parameter], optimizers: Iterable[torch.optim.Optimizer]
    ) -> list[str]:
        """Give ``params`` back their float32 storage (their masters' values) and hand them
        back to the optimizers in their masters' places, with the masters' state; they leave
        the pairs. Returns their qualified names."""
        ids = {id(p) for p in params}
        released = [(name, m, w) for name, m, w in self.pairs if id(m) in ids]
        if not released:
            return []
        for _, model, master in released:
            model.data = master.data  # (grad_dtype float32: now its own dtype)
            if (hook := self._hooks.pop(id(model), None)) is not None:
                hook.remove()
        back = {id(master): model for _, model, master in released}
        for optimizer in optimizers:
            _swap_in(optimizer, back)
        self.pairs = [pair for pair in self.pairs if id(pair[1]) not in ids]
        self._index()
        return [name for name, _, _ in released]

    def take_model_writes(self) -> None:
        """Before a step (and before ``state_dict``): give each master the value of its model
        copy where the user wrote the copy since the step last did (its version counter or
        its storage moved; reading them is the whole cost when nothing was written). Where a
        written element still equals the master's rounding, the master keeps its float32
        value. The optimizer's state is kept. A parameter replaced on its module, or a
        module holding one replaced on its parent, raises."""
        now = map(dict.get, self._site_dicts, self._site_keys)
        if not all(map(operator.is_, now, self._site_params)):
            raise RuntimeError(self._replaced())
        modules_now = map(dict.get, self._module_dicts, self._module_keys)
        if not all(map(operator.is_, modules_now, self._module_objects)):
            raise RuntimeError(self._replaced_modules())
        if list(map(_ADDRESS, self._models)) != self._addresses:
            self._take_new_storage()
        if list(map(_VERSION, self._models)) != self._versions:
            self._reseed_written()

    @torch.no_grad()
    def _take_new_storage(self) -> None:
        """Copies given new storage since the step wrote them (``param.data = value``,
        ``model.float()``): each master takes the value, and the copy gets its own storage
        back, holding the master's rounding (a step graph, and a captured CUDA graph, read
        that address, in the low dtype)."""
        moved = [
            (i, pair)
            for i, (pair, seen) in enumerate(zip(self.pairs, self._addresses, strict=True))
            if pair[1].data_ptr() != seen
        ]
        for i, (name, model, master) in moved:
            value, storage = model.data, self._storages[i]
            if value.shape != storage.shape or value.device != storage.device:
                model.data = storage  # as the step left it: the refusal changes nothing
                raise RuntimeError(
                    f"O2 master weights: {name} was given a tensor of shape "
                    f"{tuple(value.shape)} on {value.device} (param.data = ..., or "
                    f"module.to(...)); its float32 master is {tuple(storage.shape)} on "
                    f"{storage.device}, and the optimizer steps the master. Write values of "
                    "the parameter's own shape and device (param.data = value and "
                    "model.float() are taken), or make a new Graph (and optimizer) for the "
                    "changed model."
                )
            _take_value(master, value, storage.dtype)
            model.data = storage
            storage.copy_(master)
        self._record()
        log.info(
            "O2: %s given new storage on the model since the last step: their float32 masters "
            "take the values, and the model holds them in %s again, in the storage the step "
            "reads (optimizer state kept).",
            ", ".join(name for _, (name, _, _) in moved),
            self._storages[moved[0][0]].dtype,
        )

    @torch.no_grad()
    def _reseed_written(self) -> None:
        """The masters of the copies written since the step wrote them take their values."""
        written = [
            pair
            for pair, seen in zip(self.pairs, self._versions, strict=True)
            if pair[1]._version != seen
        ]
        for _, model, master in written:
            _take_value(master, model, model.dtype)
        self._record()
        log.info(
            "O2: %s written on the model since the last step: their float32 masters take the "
            "values written (optimizer state kept). The model holds them in %s; to restore "
            "float32 values exactly, use the Graph's load_state_dict, which writes the masters.",
            ", ".join(name for name, _, _ in written),
            written[0][1].dtype,
        )

    def _replaced(self) -> str:
        """What :meth:`take_model_writes` says of parameters replaced on their modules."""
        gone = [
            name
            for (name, owner, key), param in zip(self.sites, self._site_params, strict=True)
            if owner.get(key) is not param
        ]
        return (
            f"O2 master weights: {', '.join(gone)} replaced on its module since the last step "
            "(module.weight = nn.Parameter(...), or the attribute deleted). Its float32 master, "
            "which the optimizer steps, belongs to the parameter the step stored in low "
            "precision, so the step would no longer train what the model holds. Write the new "
            "values into the parameter instead (with torch.no_grad(): param.copy_(value), or "
            "model.load_state_dict(state)): the next step gives them to the master. The "
            "Graph's load_state_dict restores float32 values exactly. To change the model's "
            "parameters themselves, make a new Graph (and optimizer)."
        )

    def _replaced_modules(self) -> str:
        """What :meth:`take_model_writes` says of modules replaced on their parents."""
        gone = [
            name
            for (name, owner, key), module in zip(
                self.module_sites, self._module_objects, strict=True
            )
            if owner.get(key) is not module
        ]
        return (
            f"O2 master weights: module {', '.join(gone)} replaced since the last step "
            "(parent.child = new_module, or the attribute deleted). The float32 masters the "
            "optimizer steps belong to the parameters of the module the step stored in low "
            "precision: the new module's would not be trained, nor cast as the plan reads "
            "them. Load new values into the existing module (module.load_state_dict(...), "
            "or the Graph's load_state_dict), or make a new Graph (and optimizer) for the "
            "changed model."
        )

    def point_optimizers(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Put the masters in the places of their low copies in the optimizers' groups (a
        group added after the first step holds the model's parameters)."""
        for optimizer in optimizers:
            _swap_in(optimizer, self._by_model)

    def low_parameters(self) -> list[nn.Parameter]:
        """The model's parameters stored in the low dtype (those with a master)."""
        return list(self._models)

    def master_of(self, param: torch.Tensor) -> nn.Parameter | None:
        return self._by_model.get(id(param))

    @torch.no_grad()
    def module_state(self, module: nn.Module) -> dict[str, Any]:
        """``module.state_dict()`` with each low copy's entry replaced by its float32 master:
        a checkpoint holds the masters, not their rounding (writes to the model since the
        last step taken into them first)."""
        self.take_model_writes()
        state = module.state_dict()
        for key in list(state):
            master = self.master_of(operator.attrgetter(key)(module))
            if master is not None:
                state[key] = master.detach()
        return state

    def load_module_state(self, module: nn.Module, state: dict[str, Any]) -> None:
        """Undo :meth:`module_state`: each master takes its saved float32 value, its low copy
        that value rounded, the rest loads as ``module.load_state_dict`` does."""
        state = dict(state)
        for key, value in list(state.items()):
            param = operator.attrgetter(key)(module)
            master = self.master_of(param)
            if master is not None:
                with torch.no_grad():
                    master.copy_(value)
                state[key] = value.to(param.dtype)
        module.load_state_dict(state)
        self._record()  # the copies now hold the masters' rounding: not a user's write

    def grads_to_master(self) -> None:
        """Hand the float32 gradients accumulated on the model's parameters to the masters."""
        for _, model, master in self.pairs:
            grad = model.grad
            if grad is None:
                continue  # unused this step, or already moved by the hook
            master.grad = grad if grad.dtype == torch.float32 else grad.float()
            model.grad = None

    @torch.no_grad()
    def master_to_model(self) -> None:
        """Copy the masters into the low-precision parameters: one foreach copy (casting)."""
        if self._models:
            torch._foreach_copy_(self._models, self._masters)
            self._record()  # (a CUDA graph's replay moves no counter: its capture's record holds)

    def parameter_bytes(self) -> dict[str, int]:
        """Bytes held by the model copies, the masters and their gradients right now."""

        def size(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        return {
            "model": sum(size(m) for _, m, _ in self.pairs),
            "master": sum(size(w) for _, _, w in self.pairs),
            "model_grads": sum(size(m.grad) for _, m, _ in self.pairs),
            "master_grads": sum(size(w.grad) for _, _, w in self.pairs),
        }


def _take_value(master: torch.Tensor, value: torch.Tensor, low: torch.dtype) -> None:
    """``master`` takes ``value`` written on its copy, but keeps its float32 value where
    ``value`` is the master's rounding to ``low`` (the copy's own bits written back)."""
    unchanged = value == master.to(low).to(value.dtype)
    master.copy_(torch.where(unchanged, master, value.to(master.dtype)))


def slots(
    modules: dict[str, nn.Module], kinds: tuple[str, ...], keep: Callable[[Any], bool]
) -> list[Site]:
    """Every (qualified name, dict, key) where a module of ``modules`` (at any depth) holds,
    in one of its ``kinds`` of dict (``"_parameters"``, ``"_buffers"``, ``"_modules"``), a
    value ``keep`` accepts: each slot once (a tied parameter has several slots)."""
    found: dict[tuple[int, str], Site] = {}
    for prefix, root in modules.items():
        for path, module in root.named_modules(prefix=prefix):
            for kind in kinds:
                owner = getattr(module, kind)
                for key, value in owner.items():
                    if value is not None and keep(value):
                        found.setdefault((id(owner), key), (f"{path}.{key}", owner, key))
    return list(found.values())


def _sites(modules: dict[str, nn.Module], params: set[int]) -> list[Site]:
    """Every place a module of ``modules`` holds one of ``params`` (by id)."""
    return slots(modules, ("_parameters",), lambda param: id(param) in params)


def _module_sites(modules: dict[str, nn.Module], params: set[int]) -> list[Site]:
    """Every place a module of ``modules`` holds a submodule that holds (at any depth) one of
    ``params`` (by id)."""
    return slots(
        modules, ("_modules",), lambda child: any(id(p) in params for p in child.parameters())
    )


def _swap_in(optimizer: torch.optim.Optimizer, replacements: dict[int, nn.Parameter]) -> None:
    """Put ``replacements[id(p)]`` in the place of each such ``p`` of the optimizer's groups,
    with ``p``'s state."""
    for group in optimizer.param_groups:
        for i, param in enumerate(group["params"]):
            new = replacements.get(id(param))
            if new is None:
                continue
            group["params"][i] = new
            if param in optimizer.state:
                optimizer.state[new] = optimizer.state.pop(param)


def _to_master_hook(master: nn.Parameter) -> Callable[[torch.Tensor], None]:
    """Move each gradient onto ``master``, adding in float32 (torch without ``grad_dtype``)."""

    @torch.no_grad()
    def hook(param: torch.Tensor) -> None:
        grad, param.grad = param.grad, None
        if master.grad is None:
            master.grad = grad.float()
        else:
            master.grad.add_(grad)

    return hook
