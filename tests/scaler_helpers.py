"""Shared helpers of the scaler and kernel tests: reference implementations, a sync counter, and
the torch-style "control model" training harness."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# Tensor methods that make the host wait for the device when called on a device tensor.
SYNC_METHODS = frozenset(
    {
        "item",
        "__bool__",
        "tolist",
        "cpu",
        "numpy",
        "__float__",
        "__int__",
        "__index__",
        "__complex__",
        "nonzero",
        "masked_select",
        "_local_scalar_dense",
    }
)


class SyncCounter(TorchFunctionMode):
    """Records every call of a synchronizing tensor method made while active.

    Patches nothing: a TorchFunctionMode sees the calls only inside its ``with`` block.
    ``ignore(tensor)`` exempts reads of specific host tensors (see the test using it).
    """

    def __init__(self, ignore: Callable[[torch.Tensor], bool] = lambda t: False) -> None:
        super().__init__()
        self.calls: list[str] = []
        self._ignore = ignore

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        name = getattr(func, "__name__", "")
        # A device-to-host copy (a same-device .to() is free).
        is_to_host = (
            name == "to"
            and isinstance(args[0], torch.Tensor)
            and args[0].device.type != "cpu"
            and any(
                isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu"
                for a in list(args[1:]) + list((kwargs or {}).values())
            )
        )
        is_sync = name in SYNC_METHODS or is_to_host
        if is_sync and args and isinstance(args[0], torch.Tensor) and not self._ignore(args[0]):
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def ref_check_unscale(
    grads: Iterable[torch.Tensor], inv_scale: float
) -> tuple[bool, list[torch.Tensor]]:
    """Pure-PyTorch reference: (any non-finite, grads * inv_scale in fp32 rounded back)."""
    grads = list(grads)
    found = any(not bool(torch.isfinite(g).all()) for g in grads)
    out = [(g.float() * inv_scale).to(g.dtype) for g in grads]
    return found, out


def ref_sum_of_squares(grads: Iterable[torch.Tensor]) -> float:
    """Pure-PyTorch reference of the norm op's result (float64 accumulation)."""
    return float(sum(g.double().square().sum() for g in grads))


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A small MLP (torch's GradScaler tests use the same shape of model)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.ReLU()
    ).to(dtype)


def make_data(n: int, seed: int = 1, dtype: torch.dtype = torch.float32) -> list[tuple[Any, Any]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(4, 8, generator=gen, dtype=dtype),
            torch.randn(4, 8, generator=gen, dtype=dtype),
        )
        for _ in range(n)
    ]


def inject_inf(model: torch.nn.Module) -> None:
    """Overwrite one gradient with inf, as torch's GradScaler tests do."""
    model[2].weight.grad.data.fill_(float("inf"))


def params_of(*models: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for m in models for p in m.parameters()]


def clone_model_and_optimizer(
    model: torch.nn.Module, make_optimizer: Callable[[Iterable[torch.Tensor]], Any]
) -> tuple[torch.nn.Module, Any]:
    twin = copy.deepcopy(model)
    return twin, make_optimizer(twin.parameters())
