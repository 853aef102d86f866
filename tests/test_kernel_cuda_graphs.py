"""The CUDA kernel in CUDA graphs, and its device-side table cache (GPU only; skipped without).

* the table of a parameter set is written once: the table writer kernel runs on the first call
  and again only when the set of gradients changes (counted with the profiler);
* the three gradient ops and the scale update captured in a CUDA graph, with gradients allocated
  before the capture (table already cached) or inside it (table written during the capture),
  replay to the same bits as eager calls.

The host-side logic behind both (cache keys, eviction, pinning of captured tables) is tested
without a GPU by tests/test_kernel_host.py.
"""

from __future__ import annotations

import pytest
import torch

from amp_graph.ops import cuda_extension
from amp_graph.ops import scaler_ops as ops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

WRITER = "write_table_kernel"


def _kernel_launches(fn) -> dict[str, int]:
    """Names (substrings kept simple) of the CUDA kernels ``fn`` launches, with counts."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    counts: dict[str, int] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            counts[event.name] = counts.get(event.name, 0) + 1
    return counts


def _writes(counts: dict[str, int]) -> int:
    return sum(n for name, n in counts.items() if WRITER in name)


def _grads(sizes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    return [torch.randn(n, generator=gen).to(dtypes[i % 3]).cuda() for i, n in enumerate(sizes)]


def _ensure_loaded() -> None:
    ops.non_finite_check_([torch.ones(1, device="cuda")], torch.zeros((), device="cuda"))
    status = cuda_extension.extension_status()
    assert status.state == "loaded", status.detail


def test_table_is_written_once_per_parameter_set() -> None:
    _ensure_loaded()
    grads = _grads([1000 + 37 * i for i in range(300)], seed=1)  # sizes no other test uses
    found = torch.zeros((), device="cuda")
    inv = torch.ones((), device="cuda")

    def unscale() -> None:
        ops.non_finite_check_and_unscale_(grads, found, inv)

    first = _kernel_launches(unscale)
    assert _writes(first) >= 1, first
    again = _kernel_launches(lambda: [unscale() for _ in range(3)])
    assert _writes(again) == 0, again
    # Another op over the same set reuses the table too (the table does not depend on the mode).
    assert _writes(_kernel_launches(lambda: ops.non_finite_check_(grads, found))) == 0
    grads.append(torch.ones(11, device="cuda"))  # the set changed: one new table
    assert _writes(_kernel_launches(unscale)) >= 1
    assert _writes(_kernel_launches(unscale)) == 0


def _step(grads, found, inv, scale, trackers):
    """What a training step runs: check, unscale with the norm, update the scale."""
    found.zero_()
    ops.non_finite_check_(grads, found)
    sum_sq = ops.non_finite_check_unscale_and_norm_(grads, found, inv)
    ops.update_scale_(scale, trackers, found, 2.0, 0.5, 3, 1, 0.0, float("inf"))
    return sum_sq


@pytest.mark.parametrize("allocate_inside", [False, True])
def test_captured_ops_replay_like_eager_calls(allocate_inside: bool) -> None:
    _ensure_loaded()
    sizes = [5, 4096, 300_001, 17, 64, 128, 1]
    sources = [_grads(sizes, seed=s) for s in range(4)]
    sources[2][1][7] = float("inf")  # the third replay overflows

    # Eager reference.
    eager_grads = [g.clone() for g in sources[0]]
    found, inv = torch.zeros((), device="cuda"), torch.full((), 0.25, device="cuda")
    scale, trackers = torch.full((), 1024.0, device="cuda"), torch.tensor([0, 1, 0, 0]).cuda()
    expected = []
    for source in sources:
        for g, s in zip(eager_grads, source, strict=True):
            g.copy_(s)
        sum_sq = _step(eager_grads, found, inv, scale, trackers)
        expected.append(([g.clone() for g in eager_grads], sum_sq.clone(), scale.clone()))

    # Captured: static inputs, warm-up on a side stream, capture, replay.
    static_sources = [g.clone() for g in sources[0]]
    c_found, c_inv = torch.zeros((), device="cuda"), torch.full((), 0.25, device="cuda")
    c_scale, c_trackers = torch.full((), 1024.0, device="cuda"), torch.tensor([0, 1, 0, 0]).cuda()
    work = [torch.empty_like(g) for g in static_sources]

    def captured_body():
        grads = [s.clone() for s in static_sources] if allocate_inside else work
        if not allocate_inside:
            for g, s in zip(grads, static_sources, strict=True):
                g.copy_(s)
        return grads, _step(grads, c_found, c_inv, c_scale, c_trackers)

    saved = [t.clone() for t in (c_found, c_scale, c_trackers)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        captured_body()  # warm-up, as torch's CUDA graph recipe asks
    torch.cuda.current_stream().wait_stream(side)
    for t, before in zip((c_found, c_scale, c_trackers), saved, strict=True):
        t.copy_(before)  # undo the warm-up's scale update
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_grads, out_sum_sq = captured_body()
    for source, (grads, sum_sq, scale_after) in zip(sources, expected, strict=True):
        for s, new in zip(static_sources, source, strict=True):
            s.copy_(new)
        graph.replay()
        for a, b in zip(out_grads, grads, strict=True):
            assert torch.equal(a, b)
        assert torch.equal(out_sum_sq, sum_sq) and torch.equal(c_scale, scale_after)
    assert c_trackers.tolist() == trackers.tolist()
