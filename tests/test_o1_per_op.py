"""Policy O1, op by op: every op of torch.autocast's CUDA lists, compiled and run on CPU.

O1 applies torch.autocast's CUDA policy on every device. For each sample of
``tests/op_samples.py`` and both low dtypes, the op is traced, compiled with O1 and checked
against what CUDA autocast does, its category read from ``ATen/autocast_mode.h`` of the
installed torch (never from amp_graph's tables):

* plan: the op computes at the category's dtype, its floating inputs arrive at that dtype,
  and the graph returns it (``amp_graph.report``);
* numbers: the compiled output equals, bitwise, the op run on its inputs cast to that
  dtype; where CPU autocast computes the op at the same dtype, a real
  ``torch.autocast("cpu")`` run gives the same values too.

A second oracle, torch's own AutocastCUDA kernels run on fake CUDA tensors
(``op_samples.cuda_autocast_output``), checks the header reading and the samples, and
Python-level callables the samples do not reach (aliases, composites, leaf modules).
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from op_samples import (
    BANNED,
    CUDA_AUTOCAST_REGISTERED,
    FP32,
    LOWER,
    NEEDS_REAL_CUDA,
    SAMPLES,
    Inputs,
    OpSample,
    cuda_autocast_output,
    cuda_categories,
    floats,
    inputs,
    ints,
)

import amp_graph
from amp_graph.inspect.report import NodeRow
from amp_graph.policy import autocast_lists as lists

CATEGORIES = cuda_categories()  # from the header, plus the few .cpp-only registrations
LOW_DTYPES = (torch.float16, torch.bfloat16)
SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
CASTABLE = (torch.float16, torch.bfloat16, torch.float32)
CPU_REGISTERED = frozenset(
    name.removeprefix("aten::")
    for name in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU")
)


def short(dtype: torch.dtype) -> str:
    return SHORT[dtype]


def cast_floating(values: Inputs, dtype: torch.dtype) -> Inputs:
    """autocast's cast: float16/bfloat16/float32 tensors to ``dtype``; others unchanged."""
    return tuple(v.to(dtype) if v.dtype in CASTABLE else v for v in values)


@dataclass(frozen=True)
class Case:
    """One way to feed an op, and the dtype CUDA autocast computes and returns it in."""

    label: str
    inputs: Inputs
    dtype: torch.dtype


def cases(sample: OpSample, low: torch.dtype) -> list[Case]:
    """lower: fp32 inputs -> low; fp32 (and banned): low inputs -> fp32; promote: mixed
    low and fp32 inputs -> fp32, all-low inputs -> low."""
    category = CATEGORIES[sample.aten]
    if category == LOWER:
        return [Case("fp32 inputs", sample.make_inputs(torch.float32), low)]
    if category in (FP32, BANNED):
        return [Case("low inputs", sample.make_inputs(low), torch.float32)]
    all_low = sample.make_inputs(low)
    return [Case("mixed inputs", mixed(all_low), torch.float32), Case("low inputs", all_low, low)]


def mixed(values: Inputs) -> Inputs:
    """The first floating input stays low precision; the other floating ones become fp32."""
    floating = [i for i, v in enumerate(values) if v.is_floating_point()]
    assert len(floating) >= 2, "a promote sample needs two floating inputs"
    return tuple(v.float() if i in floating[1:] else v for i, v in enumerate(values))


def op_node_name(gm: fx.GraphModule) -> str:
    """The sample's one op (tuple outputs are indexed by a getitem, which is not the op)."""
    ops = [
        n for n in gm.graph.nodes if n.op.startswith("call") and n.target is not operator.getitem
    ]
    assert len(ops) == 1, f"a sample calls one op; traced {[n.format_node() for n in ops]}"
    return ops[0].name


def out_row(report: amp_graph.Report) -> NodeRow:
    return next(r for r in report.rows if r.role == "output")


# --- the table covers every op -------------------------------------------------------------


def test_samples_cover_every_cuda_table_name() -> None:
    ours = (
        lists.CUDA_LOWER_PRECISION
        | lists.CUDA_FP32
        | lists.CUDA_FP32_EXTRA
        | lists.CUDA_FP32_SET_OPT_DTYPE
        | lists.CUDA_PROMOTE
        | lists.CUDA_LOWER_PRECISION_EXTRA
        | lists.CUDA_BANNED
    )
    assert sorted(ours - SAMPLES.keys()) == [], "ops in amp_graph's CUDA tables without a sample"
    assert sorted(CATEGORIES.keys() - SAMPLES.keys()) == [], "header ops without a sample"
    assert sorted(SAMPLES.keys() - CATEGORIES.keys()) == [], "samples of ops autocast lacks"


def test_samples_are_tiny_deterministic_and_call_one_op() -> None:
    for name, sample in SAMPLES.items():
        op_node_name(fx.symbolic_trace(sample.fn))
        if sample.cpu_runnable:
            out = sample.fn(*sample.make_inputs(torch.float32))
            assert isinstance(out, torch.Tensor), f"{name}: returns {type(out).__name__}"
        for dtype in (torch.float32, *LOW_DTYPES):
            made, again = sample.make_inputs(dtype), sample.make_inputs(dtype)
            for value, same in zip(made, again, strict=True):
                assert torch.equal(value, same), f"{name}: inputs are not deterministic"
                assert value.numel() <= 128, f"{name}: keep inputs tiny"
                assert value.dtype in (dtype, torch.int64), f"{name}: an input of {value.dtype}"


# --- O1, op by op ---------------------------------------------------------------------------


@pytest.mark.parametrize("low", LOW_DTYPES, ids=short)
@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_o1_computes_each_op_as_cuda_autocast(name: str, low: torch.dtype) -> None:
    """Each sample as torch.fx traces it (a GraphModule a user brings): compile captures it
    again, to aten ops, and the graph returns the op's result at the dtype CUDA autocast gives
    it, bit for bit the op run at that dtype (the aten test above checks every op's plan)."""
    sample = SAMPLES[name]
    traced = fx.symbolic_trace(sample.fn)
    op_node_name(traced)  # the sample is one op
    for case in cases(sample, low):
        try:
            compiled = amp_graph.compile(traced, "O1", low, example_inputs=case.inputs)
        except amp_graph.CaptureError:
            # neither can CPU autocast (no kernel, or mixed dtypes only CUDA's lists resolve)
            with pytest.raises((RuntimeError, NotImplementedError)), torch.autocast("cpu", low):
                sample.fn(*case.inputs)
            continue
        out = out_row(amp_graph.report(compiled)).out
        assert out == short(case.dtype), f"{name} ({case.label}): the graph returns {out}"
        if not sample.cpu_runnable:  # no CPU kernel at all: the plan is what can be checked
            continue
        try:
            reference = sample.fn(*cast_floating(case.inputs, case.dtype))
        except RuntimeError as error:
            # CPU lacks this op's kernel at this dtype: the plan, checked above, stands in
            # for the run. Not silent: the warning names the op.
            if "not implemented for" not in str(error):
                raise
            warnings.warn(
                f"{name}: no CPU kernel at {case.dtype}; checked the plan only", stacklevel=1
            )
            continue
        out = compiled(*case.inputs)
        assert out.dtype == case.dtype, f"{name} ({case.label}): returns {out.dtype}"
        assert torch.equal(out, reference), f"{name} ({case.label}): values differ from the op"
        if name in CPU_REGISTERED:
            with torch.autocast("cpu", dtype=low):
                by_cpu_autocast = sample.fn(*case.inputs)
            if by_cpu_autocast.dtype == case.dtype:  # CPU's list computes it alike
                assert torch.equal(out, by_cpu_autocast), f"{name} ({case.label}): CPU autocast"


# --- O1 on the aten graphs amp_graph.compile captures itself ---------------------------------


class _Call(nn.Module):
    """A sample's function as a module, for torch.export."""

    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *inputs: torch.Tensor) -> Any:
        return self.fn(*inputs)


@pytest.mark.parametrize("low", LOW_DTYPES, ids=short)
@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_o1_aten_capture_matches_cuda_autocast(name: str, low: torch.dtype) -> None:
    """Each sample captured to aten ops by amp_graph.compile: every op's planned dtype is the
    one CUDA autocast's own kernels give it on fake CUDA tensors (oracles.py). A sample the
    capture cannot run on CPU must be one that torch cannot run on CPU either."""
    from oracles import cuda_autocast_mismatches

    if name not in CUDA_AUTOCAST_REGISTERED:
        pytest.skip(f"{name} registers for AutocastCUDA only in builds with cuDNN: no oracle")
    sample = SAMPLES[name]
    for case in cases(sample, low):
        try:
            compiled = amp_graph.compile(_Call(sample.fn), "O1", low, example_inputs=case.inputs)
        except amp_graph.CaptureError:
            # neither can CPU autocast (no kernel, or mixed dtypes only CUDA's lists resolve)
            with pytest.raises((RuntimeError, NotImplementedError)), torch.autocast("cpu", low):
                sample.fn(*case.inputs)
            continue
        mismatches = cuda_autocast_mismatches(compiled, case.inputs, unverifiable=("",))
        assert not [m for m in mismatches if "could not run" not in m], "\n".join(mismatches)


# --- the second oracle: torch's AutocastCUDA kernels on fake CUDA tensors ----------------


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_header_category_is_what_cuda_autocast_kernels_do(name: str) -> None:
    sample = SAMPLES[name]
    if name not in CUDA_AUTOCAST_REGISTERED:
        pytest.skip(f"{name} registers for AutocastCUDA only in builds with cuDNN")
    for low in LOW_DTYPES:
        for case in cases(sample, low):
            if CATEGORIES[name] == BANNED:
                with pytest.raises(RuntimeError, match="unsafe to autocast"):
                    cuda_autocast_output(sample.fn, case.inputs, low)
                continue
            try:
                out = cuda_autocast_output(sample.fn, case.inputs, low)
            except (RuntimeError, AssertionError) as error:  # torch.cuda asserts, too
                if not any(m in str(error) for m in NEEDS_REAL_CUDA):
                    raise
                pytest.skip(f"{name} cannot run on fake CUDA tensors: {error}")
            assert out.dtype == case.dtype, f"{name} ({case.label}, {low})"


class _Leaf(nn.Module):
    """A root module calling ``m`` once, so that symbolic tracing keeps ``m`` a leaf."""

    def __init__(self, m: nn.Module, first: bool) -> None:
        super().__init__()
        self.m, self.first = m, first

    def pick(self, out: Any) -> Any:
        return out[0] if self.first else out


class _Leaf1(_Leaf):
    def forward(self, a: torch.Tensor) -> Any:
        return self.pick(self.m(a))


class _Leaf2(_Leaf):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> Any:
        return self.pick(self.m(a, b))


class _Leaf3(_Leaf):
    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> Any:
        return self.pick(self.m(a, b, c))


def _leaf_model(m: nn.Module, arity: int, first: bool) -> nn.Module:
    return {1: _Leaf1, 2: _Leaf2, 3: _Leaf3}[arity](m, first)


_X = inputs(floats(3, 4))
_XY = inputs(floats(3, 4), floats(3, 4))
_SEQ = inputs(floats(3, 2, 3))  # (time, batch, features)
_LSTM = inputs(
    floats(3, 2, 3),
    floats(1, 2, 4),
    floats(1, 2, 4),
    floats(16, 3),
    floats(16, 4),
    floats(16),
    floats(16),
)
_IMAGE = inputs(floats(1, 4, 3, 3))
_TRIPLE = inputs(floats(3, 4), floats(3, 4), floats(3, 4))
_SQUARE = inputs(floats(3, 3))


@dataclass(frozen=True)
class PyCall:
    """A Python-level call (function, or leaf module) beyond the one-op samples."""

    fn: Callable[..., Any] | nn.Module
    make_inputs: Callable[[torch.dtype], Inputs]
    first: bool = False  # the module returns a tuple: compare its first element


def _callables() -> dict[str, PyCall]:
    return {
        # Aliases and methods of listed ops, and ops in no list.
        "torch.softmax": PyCall(lambda x: torch.softmax(x, 1), _X),
        "Tensor.softmax": PyCall(lambda x: x.softmax(1), _X),
        "Tensor.log_softmax": PyCall(lambda x: x.log_softmax(1), _X),
        "F.softmin": PyCall(lambda x: F.softmin(x, 1), _X),
        "Tensor.matmul": PyCall(lambda a, b: a.matmul(b.t()), _XY),
        "Tensor.baddbmm": PyCall(
            lambda c, a, b: c.baddbmm(a, b),
            inputs(floats(2, 3, 5), floats(2, 3, 4), floats(2, 4, 5)),
        ),
        "torch.norm": PyCall(lambda x: torch.norm(x), _X),
        "Tensor.norm": PyCall(lambda x: x.norm(dim=1), _X),
        "F.normalize": PyCall(lambda x: F.normalize(x), _X),
        "F.conv2d(padding='same')": PyCall(
            lambda x, w: F.conv2d(x, w, padding="same"),
            inputs(floats(1, 2, 5, 5), floats(3, 2, 3, 3)),
        ),
        "F.cross_entropy": PyCall(
            lambda x, t: F.cross_entropy(x, t), inputs(floats(3, 4), ints(3, high=4))
        ),
        "F.upsample_bilinear": PyCall(lambda x: F.upsample_bilinear(x, scale_factor=2), _IMAGE),
        "torch.sum(dtype=float16)": PyCall(lambda x: torch.sum(x, dtype=torch.float16), _X),
        "F.gelu (unlisted)": PyCall(lambda x: F.gelu(x), _X),
        "torch.mean (unlisted)": PyCall(lambda x: torch.mean(x), _X),
        # Unlisted aten ops whose kernels call a listed op: autocast casts at that inner op.
        "torch.square": PyCall(lambda x: torch.square(x), _X),
        "Tensor.square": PyCall(lambda x: x.square(), _X),
        "torch.linalg.norm": PyCall(lambda x: torch.linalg.norm(x), _X),
        "torch.linalg.matmul": PyCall(lambda a, b: torch.linalg.matmul(a, b.t()), _XY),
        "torch.linalg.matrix_power": PyCall(lambda a: torch.linalg.matrix_power(a, 2), _SQUARE),
        "torch.special.expm1": PyCall(lambda x: torch.special.expm1(x), _X),
        "torch.special.logsumexp": PyCall(lambda x: torch.special.logsumexp(x, 1), _X),
        "torch.special.softmax": PyCall(lambda x: torch.special.softmax(x, 1), _X),
        "torch.trapezoid": PyCall(lambda x: torch.trapezoid(x), _X),
        "F.pairwise_distance": PyCall(lambda a, b: F.pairwise_distance(a, b), _XY),
        "torch.lstm": PyCall(
            lambda x, h, c, wi, wh, bi, bh: torch.lstm(
                x, (h, c), (wi, wh, bi, bh), True, 1, 0.0, False, False, False
            )[0],
            _LSTM,
        ),
        # Python composites that symbolic tracing records as one node.
        "F.multilabel_soft_margin_loss": PyCall(
            lambda x, t: F.multilabel_soft_margin_loss(x, t),
            inputs(floats(3, 4), floats(3, 4, lo=0.0, hi=1.0)),
        ),
        "F.local_response_norm": PyCall(lambda x: F.local_response_norm(x, 2), _IMAGE),
        # Leaf modules.
        "nn.Linear": PyCall(nn.Linear(4, 5), _X),
        "nn.Bilinear": PyCall(nn.Bilinear(4, 4, 2), _XY),
        "nn.LayerNorm": PyCall(nn.LayerNorm(4), _X),
        "nn.GroupNorm": PyCall(nn.GroupNorm(2, 4), _IMAGE),
        "nn.BatchNorm1d (eval)": PyCall(nn.BatchNorm1d(4).eval(), _X),
        "nn.LSTM": PyCall(nn.LSTM(3, 4), _SEQ, first=True),
        "nn.RNN": PyCall(nn.RNN(3, 4), _SEQ, first=True),
        "nn.LSTMCell": PyCall(nn.LSTMCell(4, 2), _X, first=True),
        "nn.RNNCell(relu)": PyCall(nn.RNNCell(4, 2, nonlinearity="relu"), _X),
        "nn.MultiheadAttention": PyCall(nn.MultiheadAttention(4, 2).eval(), _TRIPLE, first=True),
        "nn.Upsample(bilinear)": PyCall(nn.Upsample(scale_factor=2, mode="bilinear"), _IMAGE),
        "nn.CrossEntropyLoss": PyCall(nn.CrossEntropyLoss(), inputs(floats(3, 4), ints(3, high=4))),
        "nn.KLDivLoss": PyCall(nn.KLDivLoss(reduction="batchmean"), _XY),
        "nn.Softplus": PyCall(nn.Softplus(), _X),
        "nn.CosineSimilarity": PyCall(nn.CosineSimilarity(), _XY),
        "nn.PReLU": PyCall(nn.PReLU(), _X),
        "nn.Softmax2d": PyCall(nn.Softmax2d(), _IMAGE),
        "nn.PairwiseDistance": PyCall(nn.PairwiseDistance(), _XY),
        "nn.LocalResponseNorm": PyCall(nn.LocalResponseNorm(2), _IMAGE),
        "nn.MultiLabelSoftMarginLoss": PyCall(
            nn.MultiLabelSoftMarginLoss(), inputs(floats(3, 4), floats(3, 4, lo=0.0, hi=1.0))
        ),
        "nn.TripletMarginWithDistanceLoss": PyCall(nn.TripletMarginWithDistanceLoss(), _TRIPLE),
    }


with torch.random.fork_rng(devices=[]):  # building modules must not move others' RNG
    CALLABLES = _callables()


@pytest.mark.parametrize("low", LOW_DTYPES, ids=short)
@pytest.mark.parametrize("label", sorted(CALLABLES))
def test_o1_python_callable_returns_what_cuda_autocast_returns(label: str, low: torch.dtype):
    case = CALLABLES[label]
    if isinstance(case.fn, nn.Module):  # a torch-level graph that keeps the module a leaf
        model = fx.symbolic_trace(_leaf_model(case.fn, len(case.make_inputs(low)), case.first))
    else:
        model = fx.symbolic_trace(case.fn)
    for given in (torch.float32, low):
        values = case.make_inputs(given)
        oracle = cuda_autocast_output(case.fn, values, low)
        expected = (oracle[0] if case.first else oracle).dtype
        compiled = amp_graph.compile(model, "O1", low, example_inputs=values)
        # The plan's output dtype (proven by FakeTensor propagation): some of these ops
        # have no CPU kernel at low precision, and the dtype is what is compared here.
        out = out_row(amp_graph.report(compiled)).out
        gm = amp_graph.frontends.compiler.as_graph_module(compiled)
        if any(n.meta["amp"].source == "cpu" for n in gm.graph.nodes if "amp" in n.meta):
            expected = torch.float32  # this CPU lacks the low kernel (tests/test_cpu_kernels)
        assert out == short(expected), (
            f"{label} with {given} inputs: CUDA autocast returns {expected}, O1 {out}\n"
            f"{amp_graph.report(compiled)}"
        )
