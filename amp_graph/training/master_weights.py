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
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn

from amp_graph.policy.python_ops import NORMALIZATION_MODULES

# Newer torch (2.13 has it): a leaf whose gradients have another dtype than the leaf.
HAS_GRAD_DTYPE = hasattr(torch.Tensor, "grad_dtype")


class MasterWeights:
    """Pairs each low-precision model parameter with a float32 master parameter."""

    def __init__(self, pairs: list[tuple[str, nn.Parameter, nn.Parameter]]) -> None:
        self.pairs = pairs  # (qualified name, model parameter (low), master parameter (fp32))
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
        weights = MasterWeights(pairs)
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

    def low_parameters(self) -> list[nn.Parameter]:
        """The model's parameters stored in the low dtype (those with a master)."""
        return list(self._models)

    def master_of(self, param: torch.Tensor) -> nn.Parameter | None:
        return self._by_model.get(id(param))

    @torch.no_grad()
    def module_state(self, module: nn.Module) -> dict[str, Any]:
        """``module.state_dict()`` with each low copy's entry replaced by its float32 master:
        a checkpoint holds the masters, not their rounding."""
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
