"""Whether one fp8 linear pays on a device: a cost model of its three GEMMs and its
quantizations, with figures measured once per device.

An fp8 linear replaces three bf16 GEMMs of the same shape (the output, ``M x K x N``, and in
backward the input's and the weight's gradients) with three float8 ones, and adds the
quantizations: each operand's amax, scale and cast (the input ``M x K`` in bf16, the weight
``K x N`` read from its float32 master, the output's gradient ``M x N``). Float8 GEMMs run
at up to twice bf16's FLOP rate on Hopper, and the quantizations are memory-bound, so fp8
pays on large GEMMs and loses on small ones. torchao's ``auto_filter`` draws that line by
fixed thresholds measured on an H100, in K and N alone. :class:`Fp8CostModel` draws it per
GEMM, tokens included, from figures measured on the device the model runs on
(:func:`amp_graph.ops.fp8_speed.measured_fp8_cost`), or given:

    time(bf16 layer) = bf16.fixed_ns + 6 M K N / bf16.flops_per_ns
    time(fp8 layer)  = fp8.fixed_ns  + 6 M K N / fp8.flops_per_ns
                                     + (5 M K + 9 K N + 5 M N) / quantize_bytes_per_ns

(a quantized element is read twice, for the amax and the cast, and written once as one byte:
5 bytes from bf16, 9 from float32). A layer runs in fp8 where its predicted time is at most
``margin`` times bf16's (0.9 by default: a prediction within 10% is no reason to change the
numerics).

Pure data: nothing here runs a kernel. Example::

    >>> from amp_graph.policy.fp8_cost import Fp8CostModel, GemmSpeed
    >>> model = Fp8CostModel(GemmSpeed(5e3, 600e3), GemmSpeed(8e3, 1200e3), 2e3)
    >>> model.pays(8192, 4096, 4096), model.pays(1024, 1024, 1024)
    (True, False)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Fp8CostModel", "GemmSpeed", "layer_flops", "quantized_bytes"]


def layer_flops(m: int, k: int, n: int) -> float:
    """The FLOPs of one linear's three GEMMs (output, input gradient, weight gradient)."""
    return 6.0 * m * k * n


def quantized_bytes(m: int, k: int, n: int) -> float:
    """What one fp8 linear's quantizations move: each element read twice (amax, cast) and
    written once as a byte; the input and the output gradient from bf16, the weight from
    float32."""
    return 5.0 * m * k + 9.0 * k * n + 5.0 * m * n


@dataclass(frozen=True)
class GemmSpeed:
    """A layer's forward and backward GEMMs in one dtype: a fixed time (launches, the
    framework's own work) and a FLOP rate."""

    fixed_ns: float
    flops_per_ns: float

    def __post_init__(self) -> None:
        for name in ("fixed_ns", "flops_per_ns"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"GemmSpeed.{name} is a finite number >= 0; got {value!r}")
        if self.flops_per_ns == 0:
            raise ValueError("GemmSpeed.flops_per_ns must be positive")

    def ns(self, flops: float) -> float:
        return self.fixed_ns + flops / self.flops_per_ns


@dataclass(frozen=True)
class Fp8CostModel:
    """The figures the per-GEMM fp8 decision weighs, for one device (see the module).

    Attributes:
        bf16: the bf16 layer's GEMMs (forward and backward).
        fp8: the float8 layer's GEMMs, its quantizations' fixed time included.
        quantize_bytes_per_ns: what the quantizations move per nanosecond.
        device: where the figures were measured (``"cuda:0"``), or ``""`` where given.
        margin: fp8 where its predicted time is at most ``margin`` times bf16's.
    """

    bf16: GemmSpeed
    fp8: GemmSpeed
    quantize_bytes_per_ns: float
    device: str = ""
    margin: float = 0.9

    def __post_init__(self) -> None:
        if not isinstance(self.bf16, GemmSpeed) or not isinstance(self.fp8, GemmSpeed):
            raise TypeError("Fp8CostModel takes a GemmSpeed for bf16 and one for fp8")
        q = self.quantize_bytes_per_ns
        if not isinstance(q, (int, float)) or not math.isfinite(q) or q <= 0:
            raise ValueError(f"Fp8CostModel.quantize_bytes_per_ns is positive; got {q!r}")
        if not isinstance(self.margin, (int, float)) or not 0 < self.margin <= 1:
            raise ValueError(f"Fp8CostModel.margin is in (0, 1]; got {self.margin!r}")

    def predict_ns(self, m: int, k: int, n: int) -> tuple[float, float]:
        """(bf16, fp8) predicted nanoseconds of one layer's forward and backward, for ``m``
        tokens, ``k`` input features and ``n`` output features."""
        flops = layer_flops(m, k, n)
        fp8 = self.fp8.ns(flops) + quantized_bytes(m, k, n) / self.quantize_bytes_per_ns
        return self.bf16.ns(flops), fp8

    def ratio(self, m: int, k: int, n: int) -> float:
        """fp8's predicted time over bf16's."""
        bf16, fp8 = self.predict_ns(m, k, n)
        return fp8 / bf16

    def pays(self, m: int, k: int, n: int) -> bool:
        return self.ratio(m, k, n) <= self.margin

    def explain(self, m: int, k: int, n: int) -> str:
        """One phrase for a decision's reason: the prediction and where it was measured."""
        bf16, fp8 = self.predict_ns(m, k, n)
        where = f"measured on {self.device}" if self.device else "given"
        return (
            f"the cost model ({where}) predicts {fp8 / bf16:.2f}x bf16's time for M={m}, "
            f"K={k}, N={n} ({fp8 / 1e3:.1f} us against {bf16 / 1e3:.1f} us forward and "
            f"backward; fp8 where <= {self.margin:g}x)"
        )

    def describe(self) -> str:
        """One line: the figures."""
        where = self.device or "given"
        return (
            f"{where}: bf16 GEMMs {self.bf16.flops_per_ns / 1e3:.1f} TFLOP/s + "
            f"{self.bf16.fixed_ns / 1e3:.1f} us, fp8 {self.fp8.flops_per_ns / 1e3:.1f} TFLOP/s "
            f"+ {self.fp8.fixed_ns / 1e3:.1f} us, quantization "
            f"{self.quantize_bytes_per_ns:.1f} GB/s"
        )
