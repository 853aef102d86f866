"""Shared test helpers: seeded models, a checked compile, and the plan-following reference."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from amp_graph.passes import AMP, Role
from torch.fx.node import map_aggregate

import amp_graph
from amp_graph.frontends import front_door
from amp_graph.ops.recompute_cost import RecomputeCost

# Tests measure behaviour, not speed: one intra-op thread keeps them fast and repeatable
# on a 2-core machine that may be running other work (OpenMP spin-waits when oversubscribed).
torch.set_num_threads(1)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--without-cpu-kernel",
        default="",
        help="comma-separated aten ops (lstm,gru) whose low-precision CPU kernels amp_graph "
        "is told are missing, as on an AVX2-only CPU (amp_graph.frontends.cpu_low_kernels), "
        "to run the "
        "suite as such a CPU would plan it",
    )


def pytest_configure(config: pytest.Config) -> None:
    missing = [op for op in config.getoption("--without-cpu-kernel").split(",") if op]
    if missing:
        from amp_graph.frontends import cpu_low_kernels as cpu_kernels

        def lacking(op: str) -> Any:
            def probe(dtype: torch.dtype) -> None:
                raise RuntimeError(f"{op}: no {dtype} kernel (simulated by --without-cpu-kernel)")

            return probe

        for op in missing:
            if op not in cpu_kernels.PROBES:
                raise pytest.UsageError(f"--without-cpu-kernel: {op!r} is not one of PROBES")
            cpu_kernels.PROBES[op] = lacking(op)
        cpu_kernels.reprobe()


def _recurrent_op(module: nn.Module) -> str | None:
    """The aten op a recurrent layer runs as (the keys of ``cpu_kernels.PROBES``)."""
    if type(module) is nn.RNN:
        return "rnn_tanh" if module.nonlinearity == "tanh" else "rnn_relu"
    return {nn.LSTM: "lstm", nn.GRU: "gru"}.get(type(module))


def skip_where_cpu_lacks_kernels_of(model: nn.Module, dtype: torch.dtype = torch.bfloat16):
    """Skip where this CPU has no ``dtype`` kernel for a recurrent layer of ``model``
    (:mod:`amp_graph.frontends.cpu_low_kernels`; AVX2-only CPUs have no bf16 LSTM): torch.autocast
    cannot run it there to compare, and amp_graph plans it in float32 (tests/test_cpu_kernels.py
    tests that). ``pytest --without-cpu-kernel=...`` makes this CPU such a CPU."""
    from amp_graph.frontends.cpu_low_kernels import missing_low_kernels

    missing = missing_low_kernels(dtype)
    for module in model.modules():
        op = _recurrent_op(module)
        if op in missing:
            pytest.skip(
                f"this CPU has no {dtype} kernel for aten::{op} ({missing[op]}): "
                "torch.autocast cannot run it to compare; amp_graph plans it float32"
            )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that skips without a GPU (``skipif(..., reason="needs a CUDA device")``
    or "needs a GPU") with ``cuda``: ``make gpu-check`` runs ``pytest -m cuda`` and requires
    that none of them skips there."""
    for item in items:
        for mark in item.iter_markers("skipif"):
            reason = str(mark.kwargs.get("reason", "")).lower()
            if reason.startswith(("needs a cuda", "needs a gpu")):
                item.add_marker(pytest.mark.cuda)
                break


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


# What recompute_casts="auto" (and a shared cast's reads) weighs, pinned for the suite so
# that what it decides does not depend on the machine or its load: figures as measured on a
# 2-vCPU AMD EPYC (AVX512-BF16, a cold cast at 10 GB/s, copies below 68 KiB kept, bf16
# matmuls at 0.3 TFLOP/s, a read 17 us and a cached cast at 20 GB/s: shared copies up to
# 332 KiB cast per consumer) and, for CUDA, of the order an H100's host, HBM and tensor
# cores give (copies below about 43 MiB kept, 700 TFLOP/s). tests/test_recompute_decision.py
# measures for real.
PINNED_RECOMPUTE_COSTS = {
    "cpu": RecomputeCost(
        per_cast_ns=7e3,
        per_saved_ns=2e3,
        copy_bytes_per_ns=10.0,
        device="cpu",
        flops_per_ns=300.0,
        per_read_ns=17e3,
        fresh_copy_bytes_per_ns=20.0,
    ),
    "cuda": RecomputeCost(
        per_cast_ns=30e3,
        per_saved_ns=3e3,
        copy_bytes_per_ns=1500.0,
        device="cuda",
        flops_per_ns=700e3,
        per_read_ns=15e3,
        fresh_copy_bytes_per_ns=2000.0,
    ),
}


@pytest.fixture(autouse=True)
def _pinned_recompute_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        front_door,
        "measured_cost",
        lambda device: PINNED_RECOMPUTE_COSTS[torch.device(device).type],
    )


# The two ways the consumers of a shared cast take their gradients on their own
# (Policy.cast_gradients_per_consumer), each forced by the read cost the decision weighs:
# none measured, every consumer reads the shared copy; a read of a second, every consumer
# casts its own.
SHARED_CAST_WAYS = {"reads": None, "own casts": 1e9}


@pytest.fixture(params=list(SHARED_CAST_WAYS))
def shared_cast_way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test once with each way, on the CPU; the way's name."""
    cost = dataclasses.replace(
        PINNED_RECOMPUTE_COSTS["cpu"], per_read_ns=SHARED_CAST_WAYS[request.param]
    )
    monkeypatch.setattr(front_door, "measured_cost", lambda device: cost)
    return request.param


@pytest.fixture
def torch_scaled_mm(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8 linears on ``torch._scaled_mm`` also where this CPU's kernel timed slower than
    amp_graph's float32 emulation (``cpu_scaled_mm_is_slow``, a timing probe: on some AMX
    Xeons it is), for the tests that count the scaled matmuls a probe sees dispatched."""
    from amp_graph.ops import fp8_ops

    monkeypatch.setattr(fp8_ops, "cpu_scaled_mm_is_slow", lambda: False)


@pytest.fixture
def fresh_dynamo():
    """Compile from scratch: no cached frames, no recompile limit carried over between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compile_checked(
    model: torch.nn.Module,
    policy: Any = "O1",
    dtype: torch.dtype = torch.bfloat16,
    example_inputs: Any = None,
) -> fx.GraphModule:
    """amp_graph.compile with the verifier run after every pass."""
    return amp_graph.compile(
        model, policy, dtype, example_inputs=example_inputs, check_each_pass=True
    )


def _cast(value: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return value
    castable = (torch.float16, torch.bfloat16, torch.float32)
    return map_aggregate(
        value, lambda v: v.to(dtype) if isinstance(v, torch.Tensor) and v.dtype in castable else v
    )


class PlanReference(fx.Interpreter):
    """Runs the *captured* graph (before any pass) and casts each op's floating inputs at
    run time to the compute dtype the plan recorded for it: torch.autocast's mechanism,
    implemented independently of insert_casts/simplify_casts. A compiled graph must match
    it bit for bit."""

    def __init__(self, compiled: fx.GraphModule) -> None:
        record = compiled.meta["amp_graph"]
        super().__init__(record.original)
        self.plan = {n.name: n.meta[AMP] for n in compiled.graph.nodes if AMP in n.meta}
        self.compiled = compiled

    def run_node(self, n: fx.Node) -> Any:
        info = self.plan.get(n.name)
        if n.op == "placeholder":
            value = super().run_node(n)
            return _cast(value, info.compute_dtype if info else None)
        if n.op in ("get_attr", "output") or info is None or info.role is not Role.OP:
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        args, kwargs = _cast(args, info.compute_dtype), _cast(kwargs, info.compute_dtype)
        return getattr(self, n.op)(n.target, args, kwargs)
