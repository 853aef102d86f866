"""The figures of :class:`amp_graph.policy.fp8_cost.Fp8CostModel`, measured once per device.

It times what the fp8 policy runs: one linear layer's forward and backward through the
``amp_graph`` fp8 ops (scale, quantize, the float8 linear and its backward), against the
same layer in bf16 (a weight cast and ``F.linear``), at a few shapes, and the
quantizations alone on one large tensor. Fits by least squares (float64):

* the quantizations' bandwidth: bytes moved (5 per element from bf16) over the time;
* per dtype, the layer's fixed time and FLOP rate, from the layer times less what the
  quantizations account for (fp8).

It runs at the first fp8 capture with ``Fp8Config(cost_model="measured")`` on a device
(about a second on a CPU, whose float8 products are emulated: there fp8 never pays, and
the model says so), outside any mode or autocast the caller has on, and is kept for the
process (:func:`measured_fp8_cost` is cached by device).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes

from amp_graph.ops import fp8_ops  # registers torch.ops.amp_graph.fp8_*
from amp_graph.ops.recompute_cost import best_ns, synchronizer
from amp_graph.policy.fp8_cost import Fp8CostModel, GemmSpeed, layer_flops, quantized_bytes
from amp_graph.policy.fp8_recipe import E4M3, OUT_DTYPE

__all__ = ["SHAPES", "fastest_ns", "fit_model", "layer_step", "measured_fp8_cost"]

log = logging.getLogger(__name__)
_ops = torch.ops.amp_graph

# (M, K, N) per device type: enough spread in FLOPs against bytes for the fit, each layer a
# few milliseconds at most (the CPU's float8 products are emulated in float32)
SHAPES: dict[str, tuple[tuple[int, int, int], ...]] = {
    "cuda": ((1024, 1024, 1024), (4096, 1024, 1024), (4096, 4096, 4096), (8192, 4096, 8192)),
    "cpu": ((64, 64, 64), (256, 128, 128), (256, 256, 256), (512, 256, 256)),
}
_QUANTIZED_ELEMENTS = {"cuda": 2**26, "cpu": 2**20}


def layer_step(m: int, k: int, n: int, fp8: bool, device: torch.device, recipe: str) -> Callable:
    """One step of a linear layer, forward and backward, bf16 or through the fp8 ops."""
    x = torch.randn(m, k, device=device, dtype=OUT_DTYPE, requires_grad=True)
    weight = torch.randn(n, k, device=device, requires_grad=True)
    grad = torch.randn(m, n, device=device, dtype=OUT_DTYPE)

    def bf16_step() -> None:
        F.linear(x, weight.to(OUT_DTYPE)).backward(grad)

    def fp8_step() -> None:
        x_scale = _ops.fp8_scale(x, E4M3, recipe)
        w_scale = _ops.fp8_scale(weight, E4M3, recipe)
        x_fp8 = _ops.fp8_quantize(x, x_scale, E4M3)
        w_fp8 = _ops.fp8_quantize(weight, w_scale, E4M3)
        _ops.fp8_linear(x, weight, x_fp8, x_scale, w_fp8, w_scale, None, recipe).backward(grad)

    return fp8_step if fp8 else bf16_step


def fastest_ns(run: Callable[[], object], sync: Callable[[], None]) -> float:
    """The fastest of three timed calls after one warm-up (``recompute_cost.best_ns``)."""
    run()
    return best_ns(run, sync, calls=1, rounds=3)


def fit_model(
    shapes: Sequence[tuple[int, int, int]],
    bf16_ns: Sequence[float],
    fp8_ns: Sequence[float],
    quantize_bytes_per_ns: float,
    device: str = "",
) -> Fp8CostModel:
    """The cost model from layer times at ``shapes`` and the quantizations' bandwidth: per
    dtype, ``time = fixed + flops / rate`` by least squares, fp8's times less its
    quantizations' bytes over the bandwidth. A fit that comes out negative (noise on a
    near-flat series) is held at zero fixed time and the series' mean rate."""
    flops = [layer_flops(*shape) for shape in shapes]
    moved = [quantized_bytes(*shape) for shape in shapes]
    fp8_gemm_ns = [t - b / quantize_bytes_per_ns for t, b in zip(fp8_ns, moved, strict=True)]
    return Fp8CostModel(
        _fit(flops, bf16_ns), _fit(flops, fp8_gemm_ns), quantize_bytes_per_ns, device
    )


def _fit(flops: Sequence[float], ns: Sequence[float]) -> GemmSpeed:
    a = torch.tensor([[1.0, f] for f in flops], dtype=torch.float64)
    b = torch.tensor(list(ns), dtype=torch.float64).unsqueeze(1)
    fixed, per_flop = torch.linalg.lstsq(a, b).solution.squeeze(1).tolist()
    if fixed < 0 or per_flop <= 0:
        rate = sum(flops) / max(sum(ns), 1.0)
        return GemmSpeed(0.0, max(rate, 1e-9))
    return GemmSpeed(fixed, 1.0 / per_flop)


def measured_fp8_cost(device: torch.device | str, recipe: str = "tensorwise") -> Fp8CostModel:
    """The cost model of ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``), measured once per
    device and recipe: see the module. Requires the device's float8 matmul
    (:func:`amp_graph.ops.fp8_ops.require_fp8_matmul`)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _measured(str(device), recipe)


@functools.cache
def _measured(where: str, recipe: str) -> Fp8CostModel:
    device = torch.device(where)
    fp8_ops.require_fp8_matmul(device, recipe)
    shapes = SHAPES.get(device.type, SHAPES["cpu"])
    sync = synchronizer(device)
    start = time.perf_counter()
    with (
        _disable_current_modes(),
        torch.autocast(device.type, enabled=False),
        torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
    ):
        torch.manual_seed(0)
        elements = _QUANTIZED_ELEMENTS.get(device.type, _QUANTIZED_ELEMENTS["cpu"])
        big = torch.randn(elements, device=device, dtype=OUT_DTYPE)

        def quantize() -> None:
            _ops.fp8_quantize(big, _ops.fp8_scale(big, E4M3, recipe), E4M3)

        quantize_bytes_per_ns = 5.0 * elements / fastest_ns(quantize, sync)
        bf16 = [fastest_ns(layer_step(*s, False, device, recipe), sync) for s in shapes]
        fp8 = [fastest_ns(layer_step(*s, True, device, recipe), sync) for s in shapes]
    model = fit_model(shapes, bf16, fp8, quantize_bytes_per_ns, str(device))
    log.info(
        "amp_graph fp8 cost model, measured in %.2f s: %s",
        time.perf_counter() - start,
        model.describe(),
    )
    return model
