"""benchmarks/cuda_graph_bench.py's memory accounting on the CPU: the captured Graph's pool
found through a stand-in for the CUDA capture, and the pool's segments read from a snapshot in
``torch.cuda.memory_snapshot()``'s format.

Issue 58 asks the captured step to peak at <= 1.10x the uncaptured one, and the pool
breakdown to say where the rest goes. Both figures read the Graph's pool: when that lookup
drifted from the Graph's internals, the captured row counted no pool at all (a step that
reserves nothing) and the breakdown was empty, on the GPU only and silently."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from test_cuda_graph_step import RerunCapture, Step, batch, fused_sgd, mlp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import cuda_graph_bench  # noqa: E402

POOL = (0, 7)  # torch.cuda.graph_pool_handle()'s form: a pair of ints
MIB = 2**20


class PooledRerunCapture(RerunCapture):
    """test_cuda_graph_step's stand-in for the CUDA capture, holding a pool handle once it
    has captured, as the CUDA capture does."""

    _pool: Any = None

    def capture(self, fn: Any) -> list:
        self._pool = POOL
        return super().capture(fn)


class PooledStep(Step):
    _step_capture = PooledRerunCapture


def _graph(captured: bool) -> PooledStep:
    model = mlp()
    return PooledStep(model, fused_sgd(model), captured=captured, warmup_steps=1)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return batch(torch.Generator().manual_seed(0), 8)


def test_the_pool_of_a_captured_graph_is_found_once_it_has_captured() -> None:
    graph = _graph(captured=True)
    assert cuda_graph_bench.captured_pool(graph) is None  # not called yet
    graph(*_batch())  # the warm-up
    assert cuda_graph_bench.captured_pool(graph) is None
    graph(*_batch())  # the capture
    assert cuda_graph_bench.captured_pool(graph) == POOL


def test_an_uncaptured_graph_or_a_plain_loop_has_no_pool() -> None:
    graph = _graph(captured=False)
    for _ in range(3):
        graph(*_batch())
    assert cuda_graph_bench.captured_pool(graph) is None
    assert cuda_graph_bench.captured_pool(None) is None  # a loop, not a Graph


def _segment(pool: Any, blocks: list[tuple[str, int]]) -> dict[str, Any]:
    """One segment as torch.cuda.memory_snapshot() gives it."""
    return {
        "segment_pool_id": pool,
        "total_size": sum(size for _, size in blocks),
        "blocks": [{"state": state, "size": size} for state, size in blocks],
    }


SNAPSHOT = [
    _segment((0, 0), [("active_allocated", 64 * MIB)]),  # the default pool: held tensors
    _segment(POOL, [("active_allocated", 20 * MIB), ("inactive", 12 * MIB)]),
    _segment(POOL, [("inactive", 2 * MIB)]),
    _segment((0, 9), [("inactive", 40 * MIB)]),  # another graph's pool
]


def test_the_pool_segments_are_the_pools_alone() -> None:
    segments = cuda_graph_bench.pool_segments(SNAPSHOT, POOL)
    assert [s["total_size"] for s in segments] == [32 * MIB, 2 * MIB]
    assert cuda_graph_bench.pool_segments(SNAPSHOT, None) == []


def test_the_breakdown_tells_kept_tensors_from_unused_space() -> None:
    figures = cuda_graph_bench.segments_breakdown(cuda_graph_bench.pool_segments(SNAPSHOT, POOL))
    assert figures["segments"] == 2
    assert figures["segment_mib"] == [32.0, 2.0]
    assert figures["mib_by_state"] == {"active_allocated": 20.0, "inactive": 14.0}
    assert figures["largest_blocks_mib"] == {"active_allocated": [20.0], "inactive": [12.0, 2.0]}


def test_on_the_cpu_there_are_no_device_figures() -> None:
    graph = _graph(captured=False)
    x, y = _batch()
    assert cuda_graph_bench.step_peak_bytes(graph, graph, (x, y)) is None
    assert cuda_graph_bench.pool_breakdown(graph) is None


def test_each_row_lets_go_of_what_it_held_before_the_next(monkeypatch: Any) -> None:
    """A row's Graphs sit in reference cycles (the Graph and its step builder) and its
    reduce-overhead variants' pools in dynamo's trees: unless each row lets go of them, an
    80 GB GPU holds the 8x512 rows' pools while the 64x512 rows capture theirs."""
    import gc
    import weakref

    import measure

    graph = _graph(captured=False)
    graph(*_batch())
    graphs = [weakref.ref(graph)]
    gc.disable()  # no collection but the one release makes
    try:
        del graph
        assert graphs[0]() is not None, "no cycle: nothing for release to do"
        measure.release("cpu")
        assert graphs[0]() is None
    finally:
        gc.enable()

    calls: list[str] = []
    monkeypatch.setattr(cuda_graph_bench, "release", lambda device: calls.append(device))
    argv = ["--device", "cpu", "--tiny", "--batch", "4", "--dtype", "bf16", "fp16"]
    assert cuda_graph_bench.main([*argv, "--repeats", "2", "--only", "Graph O1"]) == 0
    assert calls == ["cpu", "cpu"]  # after each of the two rows
