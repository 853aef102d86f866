"""amp_graph.Graph's float16 step on a GPU (skipped without one): no host synchronization per
step, and the step captured in a CUDA graph replays bit-equal to the uncaptured step, overflowing
batches (skipped on the device) included. The measurement code is benchmarks/graph_step_cuda.py,
which ``make gpu-check`` also runs for the timings."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_graph_step_makes_no_host_synchronization() -> None:
    import graph_step_cuda

    assert graph_step_cuda.syncs_per_step(steps=8) == 0


def test_captured_graph_step_is_bit_equal_to_eager() -> None:
    import graph_step_cuda

    result = graph_step_cuda.captured_vs_eager(steps=16, warmup=3)
    assert result["bit_equal"], result
    assert result["skipped_steps"] >= 16 // graph_step_cuda.OVERFLOW_EVERY  # skips replayed too
