"""The gradient ops' launch plans found by fingerprint, and their unboxed Python entry.

On CUDA the binding keeps a launch plan per gradient list, found again by the list's
fingerprint (each tensor's address, size and dtype, in order), and the typed entry points pass
the list to the dispatcher unboxed (``csrc/python_entry.cpp``). Neither may change a result:

* every kind of change to the list between calls (a tensor replaced, resized, of another dtype,
  added, dropped, reordered, made non-contiguous) gives the reference result of the new list;
* the unboxed entry gives torch.ops' results, declines what it must leave to Python (tensor
  subclasses, torch function modes), and leaves tracing (make_fx, torch.compile) to the ops;
* a repeated call (a plan hit) makes no host synchronization.

The CPU cases run the torch-native implementation (same semantics); the host logic of the
plans is tested without a GPU by ``host_selftest plan`` (tests/test_kernel_host.py).
"""

from __future__ import annotations

import pytest
import torch
from scaler_helpers import ref_check_unscale
from torch.overrides import TorchFunctionMode

from amp_graph.ops import cuda_extension
from amp_graph.ops import scaler_ops as ops

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _grads(sizes: list[int], device: str, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(n, generator=gen) * 10).to(DTYPES[i % 3]).to(device)
        for i, n in enumerate(sizes)
    ]


def _unscale_and_compare(grads: list[torch.Tensor], inv: float, device: str) -> None:
    before = [g.clone() for g in grads]
    found = torch.zeros((), device=device)
    ops.non_finite_check_and_unscale_(grads, found, torch.tensor(inv, device=device))
    want_found, want = ref_check_unscale(before, inv)
    assert found.item() == float(want_found)
    for i, (g, w) in enumerate(zip(grads, want, strict=True)):
        assert g.dtype == w.dtype and torch.equal(g, w), f"grads[{i}]"


CHANGES = {
    "replaced by a new tensor": lambda gs, dev: gs.__setitem__(3, torch.randn(300, device=dev)),
    "resized": lambda gs, dev: gs.__setitem__(4, torch.randn(301, device=dev).half()),
    "another dtype": lambda gs, dev: gs.__setitem__(5, gs[5].float()),
    "one added": lambda gs, dev: gs.append(torch.randn(77, device=dev).bfloat16()),
    "one dropped": lambda gs, dev: gs.pop(0),
    "reordered": lambda gs, dev: gs.reverse(),
    "non-contiguous": lambda gs, dev: gs.__setitem__(1, torch.randn(40, 30, device=dev).t()),
    "float64": lambda gs, dev: gs.__setitem__(2, torch.randn(9, device=dev).double()),
    "empty": lambda gs, dev: gs.__setitem__(6, torch.empty(0, device=dev)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("change", list(CHANGES))
def test_every_change_of_the_list_gives_the_new_lists_result(device: str, change: str) -> None:
    grads = _grads([300, 1200, 4097, 300, 301, 64, 5, 70000], device, seed=1)
    _unscale_and_compare(grads, 0.5, device)  # the plan of this list
    _unscale_and_compare(grads, 0.25, device)  # found again: a hit
    CHANGES[change](grads, device)
    _unscale_and_compare(grads, 0.5, device)  # a miss: a new plan
    _unscale_and_compare(grads, 2.0, device)  # its hit
    grads[-1][7] = float("inf")
    _unscale_and_compare(grads, 0.5, device)


@pytest.mark.parametrize("device", DEVICES)
def test_same_addresses_with_new_values_and_a_freed_list(device: str) -> None:
    """A hit reads the tensors' current values; a list freed and allocated again (the caching
    allocator hands back the same addresses) is correct whichever plan it meets."""
    for round_ in range(3):
        grads = _grads([2048, 513, 9], device, seed=round_)
        _unscale_and_compare(grads, 0.5, device)
        for g in grads:
            g.copy_(torch.randn(g.shape).to(g.dtype))
        _unscale_and_compare(grads, 0.125, device)
        del grads


class Sub(torch.Tensor):
    pass


class SeenOps(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", DEVICES)
def test_subclasses_and_torch_function_modes_still_get_the_op(device: str) -> None:
    """What the unboxed entry declines goes through torch.ops: the same result, and a torch
    function mode sees the op as before."""
    grads = _grads([100, 200, 300], device)
    _unscale_and_compare([g.as_subclass(Sub) for g in grads], 0.5, device)
    mode = SeenOps()
    with mode:
        _unscale_and_compare(grads, 0.5, device)
    assert "amp_graph.non_finite_check_and_unscale_.default" in mode.seen, mode.seen
    found = torch.zeros((), device=device)
    norm = ops.non_finite_check_unscale_and_norm_(
        (grads[0], grads[1]), found, torch.ones((), device=device)
    )
    want = sum(float(g.double().square().sum()) for g in grads[:2])
    torch.testing.assert_close(norm.item(), want, rtol=1e-5, atol=0.0)


@CUDA
def test_the_unboxed_entry_runs_plain_cuda_calls() -> None:
    grads = _grads([1000, 10, 3], "cuda")
    _unscale_and_compare(grads, 0.5, "cuda")
    assert cuda_extension.extension_status().state == "loaded"
    entry = cuda_extension.python_entry()
    assert entry is not None
    found = torch.zeros((), device="cuda")
    assert entry.check(grads, found) is True
    assert entry.check([g.as_subclass(Sub) for g in grads], found) is False


@CUDA
def test_repeated_calls_make_no_host_sync() -> None:
    grads = _grads([4096] * 50 + [3, 1000], "cuda")
    found = torch.zeros((), device="cuda")
    inv = torch.ones((), device="cuda")
    ops.non_finite_check_and_unscale_(grads, found, inv)  # build the plan, load the extension
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            ops.non_finite_check_and_unscale_(grads, found, inv)
            ops.non_finite_check_(grads, found)
            ops.non_finite_check_unscale_and_norm_(grads, found, inv)
        grads.append(torch.ones(5, device="cuda"))  # a miss builds and writes without a sync
        ops.non_finite_check_and_unscale_(grads, found, inv)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert found.item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
def test_tracing_records_the_ops(device: str) -> None:
    """make_fx and torch.compile see the ops as nodes on every device, the unboxed entry
    notwithstanding (dispatch modes are the dispatcher's; dynamo traces torch.ops)."""

    def step(grads, found, inv):
        ops.non_finite_check_and_unscale_(grads, found, inv)
        ops.non_finite_check_(grads, found)
        return ops.non_finite_check_unscale_and_norm_(grads, found, inv)

    def args():
        return (
            _grads([40, 30], device),
            torch.zeros((), device=device),
            torch.ones((), device=device),
        )

    names = [
        "amp_graph.non_finite_check_and_unscale_.default",
        "amp_graph.non_finite_check_.default",
        "amp_graph.non_finite_check_unscale_and_norm_.default",
    ]
    step(*args())  # loads the extension on CUDA: the entry is live while tracing
    gm = torch.fx.experimental.proxy_tensor.make_fx(step)(*args())
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert [t for t in targets if t.startswith("amp_graph.")] == names

    captured = []

    def backend(graph_module, example_inputs):  # type: ignore[no-untyped-def]
        captured.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    eager_args, compiled_args = args(), args()
    torch.testing.assert_close(compiled(*compiled_args), step(*eager_args), rtol=0, atol=0)
    (graph,) = captured
    calls = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert [c for c in calls if c.startswith("amp_graph.")] == names
