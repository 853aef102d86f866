"""Low-precision parameter storage with float32 master weights (policy O2 in a Graph).

The model keeps its parameters in the low-precision dtype (normalization layers excepted);
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

from collections.abc import Callable, Iterable

import torch
import torch.nn as nn

from amp_graph.policy.python_ops import NORMALIZATION_MODULES

# Newer torch (2.13 has it): a leaf whose gradients have another dtype than the leaf.
HAS_GRAD_DTYPE = hasattr(torch.Tensor, "grad_dtype")


class MasterWeights:
    """Pairs each low-precision model parameter with a float32 master parameter."""

    def __init__(self, pairs: list[tuple[str, nn.Parameter, nn.Parameter]]) -> None:
        self.pairs = pairs  # (qualified name, model parameter (low), master parameter (fp32))
        self._by_model = {id(model): master for _, model, master in pairs}
        self._models = [model for _, model, _ in pairs]
        self._masters = [master for _, _, master in pairs]
        for _, model, master in pairs:
            if HAS_GRAD_DTYPE:
                model.grad_dtype = torch.float32
            elif model.requires_grad:
                model.register_post_accumulate_grad_hook(_to_master_hook(master))

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
            weights._retarget(optimizer)
        return weights

    def _retarget(self, optimizer: torch.optim.Optimizer) -> None:
        for group in optimizer.param_groups:
            for i, param in enumerate(group["params"]):
                master = self._by_model.get(id(param))
                if master is None:
                    continue
                group["params"][i] = master
                if param in optimizer.state:
                    optimizer.state[master] = optimizer.state.pop(param)

    def master_of(self, param: torch.Tensor) -> nn.Parameter | None:
        return self._by_model.get(id(param))

    @torch.no_grad()
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
