"""amp_graph's op tables against the installed torch: the header, the dispatcher, real autocast.

* CUDA tables == the ``AT_FORALL_*`` macros of ``ATen/autocast_mode.h`` (parsed here);
* CPU tables == the ops registered for the ``AutocastCPU`` dispatch key; every
  ``AutocastCUDA`` registration is in the CUDA tables;
* each CPU table's category is what ``torch.autocast("cpu")`` does to the op, run;
* one category per base op name and device (amp_graph looks ops up by base name);
* every entry of ``python_ops`` names a real aten op, and policy ``"autocast"`` gives what
  ``torch.autocast("cpu")`` gives for common Python-level callables.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from conftest import skip_where_cpu_lacks_kernels_of
from op_samples import (
    HEADER,
    SAMPLES,
    Inputs,
    OpSample,
    autocast_header_lists,
    floats,
    inputs,
    ints,
)

import amp_graph
from amp_graph.policy import autocast_lists as lists
from amp_graph.policy import base_name, python_ops

HEADER_LISTS = autocast_header_lists()
BF16, FP32 = torch.bfloat16, torch.float32
CASTABLE = (torch.float16, torch.bfloat16, torch.float32)


def registered(dispatch_key: str) -> frozenset[str]:
    """Op names (``"conv1d.padding"``) with a kernel for ``dispatch_key`` in this build: torch's
    own, not those of ``torch.library.custom_op``s another test in this process registered
    (``register_autocast``, tests/test_custom_ops.py)."""
    from torch._library.custom_ops import OPDEFS

    names = torch._C._dispatch_get_registrations_for_dispatch_key(dispatch_key)
    return frozenset(name.removeprefix("aten::") for name in names if name not in OPDEFS)


def cast_floating(values: Inputs, dtype: torch.dtype) -> Inputs:
    return tuple(v.to(dtype) if v.dtype in CASTABLE else v for v in values)


# --- (a) the CUDA tables are the header's macros --------------------------------------------


OP_MACROS = (
    "AT_FORALL_LOWER_PRECISION_FP",
    "AT_FORALL_FP32",
    "AT_FORALL_FP32_SET_OPT_DTYPE",
    "AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE",
    "AT_FORALL_PROMOTE",
)


def test_header_parser_reads_every_entry() -> None:
    # A new AT_FORALL_* op list in a later torch fails here, not silently.
    assert set(HEADER_LISTS) == {*OP_MACROS, "AT_FORALL_DEPRECATED_AUTOCAST_BACKENDS"}
    text = HEADER.read_text()
    for macro in OP_MACROS:
        body = re.search(rf"#define {macro}\(_\)((?:[^\n]*\\\n)*[^\n]*)", text).group(1)
        names = HEADER_LISTS[macro]
        assert names and len(names) == body.count("_("), f"{macro}: parsed {len(names)} entries"
        for name in names:
            op, _, overload = name.partition(".")
            assert (overload or "default") in getattr(torch.ops.aten, op).overloads(), name


def test_cuda_lower_precision_is_the_header_list() -> None:
    assert HEADER_LISTS["AT_FORALL_LOWER_PRECISION_FP"] == lists.CUDA_LOWER_PRECISION


def test_cuda_fp32_is_the_header_list() -> None:
    assert HEADER_LISTS["AT_FORALL_FP32"] == lists.CUDA_FP32


def test_cuda_fp32_set_opt_dtype_is_the_header_list_plus_norm() -> None:
    header = (
        HEADER_LISTS["AT_FORALL_FP32_SET_OPT_DTYPE"]
        | HEADER_LISTS["AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE"]
    )
    assert HEADER_LISTS["AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE"] == {
        "norm.Scalar",
        "norm.ScalarOpt_dim",
    }
    assert header == lists.CUDA_FP32_SET_OPT_DTYPE


def test_cuda_promote_is_the_header_list() -> None:
    assert HEADER_LISTS["AT_FORALL_PROMOTE"] == lists.CUDA_PROMOTE


# --- (b) the dispatcher's registrations ------------------------------------------------------


def test_autocast_cpu_registrations_are_the_cpu_tables() -> None:
    ours = lists.CPU_LOWER_PRECISION | lists.CPU_FP32 | lists.CPU_PROMOTE
    cpu = registered("AutocastCPU")
    assert sorted(cpu - ours) == [], "registered for AutocastCPU, missing from the CPU tables"
    assert sorted(ours - cpu) == [], "in the CPU tables, not registered for AutocastCPU"


def test_autocast_cuda_registrations_are_the_cuda_tables() -> None:
    ours = (
        lists.CUDA_LOWER_PRECISION
        | lists.CUDA_LOWER_PRECISION_EXTRA
        | lists.CUDA_FP32
        | lists.CUDA_FP32_EXTRA
        | lists.CUDA_FP32_SET_OPT_DTYPE
        | lists.CUDA_PROMOTE
        | lists.CUDA_BANNED
    )
    cuda = registered("AutocastCUDA")
    assert sorted(cuda - ours) == [], "registered for AutocastCUDA, missing from the CUDA tables"
    # _cudnn_rnn registers from aten/src/ATen/cudnn/AutocastRNN.cpp, which only builds with
    # cuDNN: a CPU-only torch (like CI's) lacks that one registration, and only that one.
    not_built = set() if torch.backends.cudnn.is_available() else {"_cudnn_rnn"}
    assert ours - cuda == not_built


# --- (c) each CPU table's category is what torch.autocast("cpu") does ------------------------

_VOLUME = inputs(floats(1, 2, 4, 4, 4))
_SQUARE = inputs(floats(3, 3))
_CPU_ONLY: list[OpSample] = [
    OpSample(
        "conv1d.padding",
        lambda x, w: F.conv1d(x, w, padding="same"),
        inputs(floats(1, 2, 6), floats(3, 2, 3)),
    ),
    OpSample(
        "conv2d.padding",
        lambda x, w: F.conv2d(x, w, padding="same"),
        inputs(floats(1, 2, 5, 5), floats(3, 2, 3, 3)),
    ),
    OpSample(
        "conv3d.padding",
        lambda x, w: F.conv3d(x, w, padding="same"),
        inputs(floats(1, 2, 3, 3, 3), floats(3, 2, 2, 2, 2)),
    ),
    OpSample(
        "_addmm_activation",
        lambda c, a, b: torch.ops.aten._addmm_activation.default(c, a, b),
        inputs(floats(3, 5), floats(3, 4), floats(4, 5)),
    ),
    OpSample("avg_pool3d", lambda x: F.avg_pool3d(x, 2), _VOLUME),
    OpSample("max_pool3d", lambda x: F.max_pool3d(x, 2), _VOLUME),
    OpSample("adaptive_avg_pool3d", lambda x: F.adaptive_avg_pool3d(x, 2), _VOLUME),
    OpSample("adaptive_max_pool3d", lambda x: F.adaptive_max_pool3d(x, 2), _VOLUME),
    OpSample(
        "reflection_pad1d", lambda x: F.pad(x, (1, 1), mode="reflect"), inputs(floats(1, 2, 4))
    ),
    OpSample(
        "reflection_pad2d",
        lambda x: F.pad(x, (1, 1, 1, 1), mode="reflect"),
        inputs(floats(1, 2, 3, 3)),
    ),
    OpSample(
        "replication_pad1d", lambda x: F.pad(x, (1, 1), mode="replicate"), inputs(floats(1, 2, 4))
    ),
    OpSample(
        "replication_pad2d",
        lambda x: F.pad(x, (1, 1, 1, 1), mode="replicate"),
        inputs(floats(1, 2, 3, 3)),
    ),
    OpSample(
        "replication_pad3d",
        lambda x: F.pad(x, (1, 1, 1, 1, 1, 1), mode="replicate"),
        inputs(floats(1, 2, 2, 2, 2)),
    ),
    OpSample(
        "cross_entropy_loss",
        lambda x, t: F.cross_entropy(x, t),
        inputs(floats(3, 4), ints(3, high=4)),
    ),
    OpSample("fft_fft", lambda x: torch.fft.fft(x), inputs(floats(8))),
    OpSample("fft_rfft", lambda x: torch.fft.rfft(x), inputs(floats(8))),
    OpSample("fft_fft2", lambda x: torch.fft.fft2(x), inputs(floats(4, 4))),
    OpSample("trace", lambda x: torch.trace(x), _SQUARE),
    OpSample("inverse", lambda x: torch.inverse(x), _SQUARE),
    OpSample("linalg_inv", lambda x: torch.linalg.inv(x), _SQUARE),
    OpSample("linalg_svdvals", lambda x: torch.linalg.svdvals(x), _SQUARE),
    OpSample("linalg_eigvalsh", lambda x: torch.linalg.eigvalsh(x), _SQUARE),
    OpSample("linalg_cond", lambda x: torch.linalg.cond(x), _SQUARE),
    OpSample("pinverse", lambda x: torch.pinverse(x), _SQUARE),
    OpSample("quantile.scalar", lambda x: torch.quantile(x, 0.25), inputs(floats(10))),
    OpSample(
        "polar",
        lambda r, theta: torch.polar(r, theta),
        inputs(floats(5, lo=0.5, hi=2.0), floats(5)),
    ),
    OpSample("view_as_complex", lambda x: torch.view_as_complex(x), inputs(floats(3, 2))),
    OpSample("cat", lambda a, b: torch.cat([a, b]), inputs(floats(2, 3), floats(2, 3))),
    OpSample("stack", lambda a, b: torch.stack([a, b]), inputs(floats(2, 3), floats(2, 3))),
    OpSample(
        "index_copy",
        lambda x, i, s: x.index_copy(0, i, s),
        inputs(floats(4, 3), ints(2, high=4), floats(2, 3)),
        note="raises unless promoted",
    ),
]
CPU_TABLES = {
    "lower": lists.CPU_LOWER_PRECISION,
    "fp32": lists.CPU_FP32,
    "promote": lists.CPU_PROMOTE,
}
CPU_SAMPLES: dict[str, OpSample] = {
    **{
        name: s
        for name, s in SAMPLES.items()
        if s.cpu_runnable and any(name in table for table in CPU_TABLES.values())
    },
    **{s.aten: s for s in _CPU_ONLY},
}


def test_cpu_tables_are_checked_on_enough_ops() -> None:
    in_tables = frozenset().union(*CPU_TABLES.values())
    assert sorted(CPU_SAMPLES.keys() - in_tables) == [], "a local sample of an unlisted op"
    assert len(CPU_SAMPLES) >= 25
    assert all(CPU_SAMPLES.keys() & table for table in CPU_TABLES.values())


@pytest.mark.parametrize("name", sorted(CPU_SAMPLES))
def test_cpu_table_category_is_what_cpu_autocast_does(name: str) -> None:
    sample = CPU_SAMPLES[name]
    category = next(c for c, table in CPU_TABLES.items() if name in table)
    if category == "lower":  # fp32 in, bf16 computed and out
        given, compute = sample.make_inputs(FP32), BF16
    elif category == "fp32":  # bf16 in, fp32 computed (fp32 or complex64 out)
        given, compute = sample.make_inputs(BF16), FP32
    else:  # promote: bf16 and fp32 in, fp32 computed and out
        all_low = sample.make_inputs(BF16)
        given, compute = (
            (all_low[0], *(v.float() if v.is_floating_point() else v for v in all_low[1:])),
            FP32,
        )
    with torch.autocast("cpu", dtype=BF16):
        out = sample.fn(*given)
    reference = sample.fn(*cast_floating(given, compute))
    assert reference.dtype in (compute, torch.complex64), f"{name}: a sample of an odd op"
    assert out.dtype == reference.dtype, f"{name} ({category}): autocast returns {out.dtype}"
    assert torch.equal(out, reference), f"{name} ({category}): values differ"


# --- (d) amp_graph looks ops up by base name: one category per base name ---------------------

_BY_DEVICE = {
    "cpu": {
        "lower": lists.CPU_LOWER_PRECISION,
        "fp32": lists.CPU_FP32,
        "promote": lists.CPU_PROMOTE,
    },
    "cuda": {
        "lower": lists.CUDA_LOWER_PRECISION | lists.CUDA_LOWER_PRECISION_EXTRA,
        "fp32": (
            lists.CUDA_FP32
            | lists.CUDA_FP32_EXTRA
            | lists.CUDA_FP32_SET_OPT_DTYPE
            | lists.CUDA_BANNED
        ),
        "promote": lists.CUDA_PROMOTE,
    },
    "cuda header": {
        "lower": HEADER_LISTS["AT_FORALL_LOWER_PRECISION_FP"],
        "fp32": (
            HEADER_LISTS["AT_FORALL_FP32"]
            | HEADER_LISTS["AT_FORALL_FP32_SET_OPT_DTYPE"]
            | HEADER_LISTS["AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE"]
        ),
        "promote": HEADER_LISTS["AT_FORALL_PROMOTE"],
    },
}


@pytest.mark.parametrize("device", sorted(_BY_DEVICE))
def test_no_base_name_has_two_categories(device: str) -> None:
    categories: dict[str, set[str]] = {}
    for category, names in _BY_DEVICE[device].items():
        for name in names:
            categories.setdefault(name.split(".")[0], set()).add(category)
    assert {b: c for b, c in categories.items() if len(c) > 1} == {}


def test_base_name_is_the_name_before_the_overload() -> None:
    assert base_name("softmax.int") == "softmax" == base_name("softmax")
    assert base_name("_convolution.deprecated") == "_convolution"


# --- (e) python_ops: every entry names a real op; policy "autocast" is CPU autocast ----------


def _all_candidates() -> list[tuple[str, str]]:
    entries: list[tuple[str, str]] = []
    for table in (python_ops.FUNCTIONS, python_ops.MODULES, python_ops.OPERATORS):
        for key, candidates in table.items():
            assert candidates, f"{key!r} has no candidate aten op"
            entries += [(getattr(key, "__name__", repr(key)), name) for name in candidates]
    return entries


def test_python_ops_candidates_are_aten_ops() -> None:
    tables = frozenset().union(*(t for d in _BY_DEVICE.values() for t in d.values()))
    known = {base_name(n) for n in tables} | python_ops.NORMALIZATION_OPS
    unknown = sorted(
        {
            f"{key} -> {name}"
            for key, name in _all_candidates()
            if base_name(name) not in known and not hasattr(torch.ops.aten, base_name(name))
        }
    )
    assert unknown == []


class _Root(nn.Module):
    """A root module calling ``m`` once, so that symbolic tracing keeps ``m`` a leaf."""

    def __init__(self, m: nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, x: torch.Tensor) -> Any:
        out = self.m(x)
        return out[0] if isinstance(self.m, (nn.RNNBase, nn.LSTMCell)) else out


_MATRIX = inputs(floats(3, 4))
_PAIR = inputs(floats(3, 4), floats(3, 4))
_IMAGE = inputs(floats(1, 4, 3, 3))
_VOLUME_4 = inputs(floats(1, 2, 4, 4, 4))
_ATTENTION = inputs(floats(1, 2, 3, 4), floats(1, 2, 3, 4), floats(1, 2, 3, 4))
Call = tuple[Callable[..., Any] | nn.Module, Callable[[torch.dtype], Inputs]]


def _cpu_callables() -> dict[str, Call]:
    return {
        "F.softmax": (lambda x: F.softmax(x, dim=-1), _MATRIX),
        "F.cross_entropy": (
            lambda x, t: F.cross_entropy(x, t),
            inputs(floats(3, 4), ints(3, high=4)),
        ),
        "F.layer_norm": (lambda x: F.layer_norm(x, (4,)), _MATRIX),
        "F.gelu": (lambda x: F.gelu(x), _MATRIX),
        "nn.LSTM": (nn.LSTM(3, 4), inputs(floats(3, 2, 3))),
        "nn.Linear": (nn.Linear(4, 2), _MATRIX),
        "F.scaled_dot_product_attention": (
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
            _ATTENTION,
        ),
        "torch.einsum": (lambda a, b: torch.einsum("ij,kj->ik", a, b), _PAIR),
        "F.normalize": (lambda x: F.normalize(x), _MATRIX),
        "F.interpolate(bilinear)": (
            lambda x: F.interpolate(x, scale_factor=2.0, mode="bilinear"),
            _IMAGE,
        ),
        "F.mse_loss": (lambda x, t: F.mse_loss(x, t), _PAIR),
        "nn.GroupNorm": (nn.GroupNorm(2, 4), _IMAGE),
        # The aten op under F.pad and F.interpolate depends on the input's rank as well as
        # on `mode`: adaptive_avg_pool3d is in the CPU fp32 list, reflection_pad3d in none.
        "F.interpolate(area, 5-d)": (
            lambda x: F.interpolate(x, size=(2, 2, 2), mode="area"),
            _VOLUME_4,
        ),
        "F.pad(reflect, 5-d)": (
            lambda x: F.pad(x, (1, 1, 1, 1, 1, 1), mode="reflect"),
            inputs(floats(1, 2, 3, 3, 3)),
        ),
        # Composites of ops in the CPU lists: autocast casts at the inner mm/linear/avg_pool3d.
        "torch.tensordot": (
            lambda a, b: torch.tensordot(a, b, dims=1),
            inputs(floats(3, 4), floats(4, 2)),
        ),
        "torch.linalg.multi_dot": (
            lambda a, b, c: torch.linalg.multi_dot([a, b, c]),
            inputs(floats(2, 3), floats(3, 4), floats(4, 2)),
        ),
        "nn.LSTMCell": (nn.LSTMCell(4, 2), _MATRIX),
        "nn.GRU": (nn.GRU(3, 4), inputs(floats(3, 2, 3))),
        "nn.LocalResponseNorm": (nn.LocalResponseNorm(2), _IMAGE),
    }


with torch.random.fork_rng(devices=[]):  # building modules must not move others' RNG
    CPU_CALLABLES = _cpu_callables()


# Documented limits (README, "Known limits"): on CPU, the GRU and the LSTM cell run their
# matmuls in bf16 under torch.autocast but then promote back to their float32 initial hidden
# state; amp_graph casts the inputs of the one aten.gru / aten.lstm_cell node, so its output
# stays bf16. The test pins the deviation so that a change either way is noticed.
KNOWN_DEVIATIONS = {("nn.GRU", FP32): BF16, ("nn.LSTMCell", FP32): BF16}


@pytest.mark.parametrize("label", sorted(CPU_CALLABLES))
def test_autocast_policy_returns_what_cpu_autocast_returns(label: str) -> None:
    fn, make_inputs = CPU_CALLABLES[label]
    model = _Root(fn) if isinstance(fn, nn.Module) else fx.symbolic_trace(fn)
    skip_where_cpu_lacks_kernels_of(model)
    for given in (FP32, BF16):
        values = make_inputs(given)
        compiled = amp_graph.compile(model, "autocast", BF16, example_inputs=values)
        out = compiled(*values)
        try:
            with torch.autocast("cpu", dtype=BF16):
                expected = model(*values)
        except RuntimeError as error:  # oneDNN's bf16 LSTM needs bf16 instructions
            assert "primitive" in str(error), error
            assert out.dtype == BF16 and torch.isfinite(out.float()).all()
            continue
        if (label, given) in KNOWN_DEVIATIONS:
            assert expected.dtype == FP32
            assert out.dtype == KNOWN_DEVIATIONS[label, given]
            continue
        assert out.dtype == expected.dtype, (
            f"{label} with {given} inputs: torch.autocast gives {expected.dtype}, amp_graph "
            f"{out.dtype}\n{amp_graph.report(compiled)}"
        )
