"""The amp_graph custom ops against pure-PyTorch references, opcheck, and graph capture.

Device-parametrized: the CPU cases run everywhere (torch-native implementation); the CUDA cases
run the extension's fused kernel and skip cleanly without a GPU.
"""

from __future__ import annotations

import types

import pytest
import torch
from scaler_helpers import ref_check_unscale, ref_sum_of_squares

from amp_graph.ops import cuda_extension
from amp_graph.ops import scaler_ops as ops

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ),
]
SPECIALS = [float("inf"), float("-inf"), float("nan")]


def _finite(shape, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 100).to(dtype).to(device)


def _shapes(device: str) -> dict[str, torch.Tensor]:
    """Layouts the kernel must handle, as views of fresh fp32 data (cast per test)."""
    huge = 2**22 + 7 if device == "cuda" else 2**18 + 7
    base = torch.randn(64, 48)
    return {
        "empty": torch.empty(0),
        "empty_2d": torch.empty(0, 5),
        "scalar": torch.tensor(3.0),
        "tiny": torch.randn(3),
        "huge": torch.randn(huge),
        "non_contiguous": base[:, ::3],
        "sliced": torch.randn(1001)[5:998],
        "transposed": base.t(),
        "expanded_row": torch.randn(1, 40).expand(7, 40),  # overlapping: read-only cases only
    }


def _run(kind: str, grads, found, inv):
    if kind == "unscale":
        ops.non_finite_check_and_unscale_(grads, found, inv)
        return None
    if kind == "norm":
        return ops.non_finite_check_unscale_and_norm_(grads, found, inv)
    ops.non_finite_check_(grads, found)
    return None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["unscale", "norm", "check"])
def test_layouts_against_reference(kind: str, dtype: torch.dtype, device: str) -> None:
    for name, t in _shapes(device).items():
        if name == "expanded_row" and kind != "check":
            continue  # in-place writes into overlapping memory are undefined in torch too
        g = t.to(dtype=dtype, device=device) if name != "expanded_row" else t.to(dtype).to(device)
        before, strides = g.clone(), g.stride()
        found = torch.zeros((), device=device)
        inv = torch.tensor(0.125, device=device)
        result = _run(kind, [g], found, inv)
        expect_found, expect = ref_check_unscale([before], 0.125)
        assert bool(found) is expect_found, name
        if kind == "check":
            assert torch.equal(g, before), f"{name}: check-only must not write"
        else:
            torch.testing.assert_close(g, expect[0], rtol=0, atol=0, msg=name)
            assert g.stride() == strides
        if kind == "norm":
            torch.testing.assert_close(
                result.item(), ref_sum_of_squares(expect), rtol=2e-5, atol=1e-30
            )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values_at_every_lane_head_and_tail(dtype: torch.dtype, device: str) -> None:
    """inf/-inf/nan at every position of a 16-byte vector, in the head and in the tail, for every
    misalignment of the tensor's start; the rest must still be unscaled, found_inf set."""
    lanes = 16 // torch.empty((), dtype=dtype).element_size()
    storage = _finite(8 * lanes + 64, dtype, device)
    for offset in range(lanes):
        length = 3 * lanes + lanes // 2 + 1  # head + whole vectors + a tail
        for position in range(length):
            for special in SPECIALS:
                g = storage.clone()[offset : offset + length]
                g[position] = special
                before = g.clone()
                found = torch.zeros((), device=device)
                for kind in ("check", "unscale"):
                    found.zero_()
                    _run(kind, [g], found, torch.tensor(0.5, device=device))
                    assert found.item() == 1.0, (offset, position, special, kind)
                expect = (before.float() * 0.5).to(dtype)
                torch.testing.assert_close(g, expect, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
def test_thousands_of_mixed_tensors_in_one_call(device: str) -> None:
    gen = torch.Generator().manual_seed(3)
    sizes = torch.randint(0, 300, (3000,), generator=gen).tolist()
    grads = [
        _finite(n, DTYPES[i % 3], device, seed=i)[i % 5 :]
        if n > 5
        else _finite(n, torch.float16, device, seed=i)
        for i, n in enumerate(sizes)
    ]
    before = [g.clone() for g in grads]
    found = torch.zeros((), device=device)
    total = ops.non_finite_check_unscale_and_norm_(grads, found, torch.tensor(0.25, device=device))
    assert found.item() == 0.0
    _, expect = ref_check_unscale(before, 0.25)
    for g, e in zip(grads, expect, strict=True):
        assert torch.equal(g, e)
    torch.testing.assert_close(total.item(), ref_sum_of_squares(expect), rtol=1e-5, atol=0.0)

    grads[2718][-1] = float("nan")
    ops.non_finite_check_(grads, found)
    assert found.item() == 1.0


@pytest.mark.parametrize("device", DEVICES)
def test_found_inf_is_never_cleared_and_other_dtypes_work(device: str) -> None:
    found = torch.ones((), device=device)
    grads = [torch.ones(10, device=device), torch.ones(4, dtype=torch.float64, device=device)]
    ops.non_finite_check_and_unscale_(grads, found, torch.tensor(0.5, device=device))
    assert found.item() == 1.0
    assert torch.equal(grads[1], torch.full((4,), 0.5, dtype=torch.float64, device=device))
    found.zero_()
    grads[1][2] = float("inf")  # float64 takes the torch-native path, same semantics
    ops.non_finite_check_(grads, found)
    assert found.item() == 1.0


@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments_are_rejected(device: str) -> None:
    """The same ValueError texts from the native path (CPU) and the kernel's binding (CUDA),
    sizes and indices in them (on an H200 the binding's integer-formatting errors once
    crashed the process instead)."""
    g = [torch.ones(3, device=device)]
    with pytest.raises(
        ValueError,
        match=r"found_inf must be a one-element float32 tensor, "
        r"got torch.float32 \(2,\)$",
    ):
        ops.non_finite_check_(g, torch.zeros(2, device=device))
    with pytest.raises(
        ValueError,
        match=r"inv_scale must be a one-element float32 tensor, "
        r"got torch.float64 \(\)$",
    ):
        ops.non_finite_check_and_unscale_(
            g, torch.zeros((), device=device), torch.ones((), dtype=torch.float64, device=device)
        )
    with pytest.raises(ValueError, match=r"grads\[1\] is torch.int64$"):
        ops.non_finite_check_(
            [*g, torch.ones(2, dtype=torch.int64, device=device)], torch.zeros((), device=device)
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["unscale", "norm", "check"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.bool, torch.complex64])
def test_non_floating_grads_are_rejected_on_every_path(
    kind: str, dtype: torch.dtype, device: str
) -> None:
    """One semantics: the native path (CPU) and the kernel (CUDA) refuse the same inputs."""
    grads = [torch.ones(3, device=device), torch.ones(4, device=device).to(dtype)]
    found = torch.zeros((), device=device)
    with pytest.raises(ValueError, match=r"floating-point tensors; grads\[1\]"):
        _run(kind, grads, found, torch.tensor(0.5, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_sum_of_squares_rule(device: str) -> None:
    """float32 squares of the stored values, one sum per dtype group (float32, float16,
    bfloat16, others), then their sum: exact on the native path, to float32 rounding on CUDA
    (its in-group order is per block)."""
    gen = torch.Generator().manual_seed(7)
    dtypes = [torch.bfloat16, torch.float32, torch.float64, torch.float16]
    grads = [
        (torch.randn(int(n), generator=gen) * 10).to(dtypes[i % 4]).to(device)
        for i, n in enumerate(torch.randint(1, 3000, (40,), generator=gen))
    ]
    found = torch.zeros((), device=device)
    total = ops.non_finite_check_unscale_and_norm_(grads, found, torch.tensor(0.5, device=device))
    expected = torch.zeros(())
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        group = [g.cpu().float().square().sum() for g in grads if g.dtype == dtype]
        expected += torch.stack(group).sum()
    if device == "cpu":
        assert torch.equal(total, expected)
    else:
        torch.testing.assert_close(total.cpu(), expected, rtol=1e-5, atol=0)
    assert total.dtype == torch.float32 and found.item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
def test_update_scale_matches_torch(device: str) -> None:
    scale, tracker = (
        torch.tensor(512.0, device=device),
        torch.zeros((), dtype=torch.int32, device=device),
    )
    ours, trackers = torch.tensor(512.0, device=device), torch.tensor([0, 1, 0, 0], device=device)
    for flag in "0010001101110000100":
        found = torch.tensor(float(flag), device=device)
        torch._amp_update_scale_(scale, tracker, found, 2.0, 0.5, 3)
        ops.update_scale_(ours, trackers, found, 2.0, 0.5, 3, 1, 0.0, float("inf"))
        assert ours.item() == scale.item() and trackers[0].item() == tracker.item()
    assert trackers[ops.SKIPPED_STEPS].item() == "0010001101110000100".count("1")


def _opcheck_cases(device: str):
    def grads():
        return [
            torch.randn(5, device=device),
            torch.randn(3, 4, dtype=torch.float16, device=device).t(),
            torch.randn(9, dtype=torch.bfloat16, device=device)[1:],
            torch.tensor([1.0, float("inf")], device=device),
        ]

    zero = torch.zeros((), device=device)
    inv = torch.tensor(0.25, device=device)
    amp = torch.ops.amp_graph
    return [
        (amp.non_finite_check_and_unscale_.default, (grads(), zero.clone(), inv)),
        (amp.non_finite_check_and_unscale_.default, ([], zero.clone(), inv)),
        (amp.non_finite_check_.default, (grads(), zero.clone())),
        (amp.non_finite_check_unscale_and_norm_.default, (grads(), zero.clone(), inv)),
        (
            amp.update_scale_.default,
            (
                torch.tensor(4.0, device=device),
                torch.tensor([0, 2, 0, 0], device=device),
                torch.ones((), device=device),
                2.0,
                0.5,
                3,
                2,
                1.0,
                2.0**24,
            ),
        ),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device: str) -> None:
    for op, args in _opcheck_cases(device):
        torch.library.opcheck(op, args)


def test_each_op_is_one_node_in_fx_and_compiled_graphs() -> None:
    def step(grads, found, inv, scale, trackers):
        ops.non_finite_check_(grads, found)
        ops.non_finite_check_and_unscale_(grads, found, inv)
        sum_sq = ops.non_finite_check_unscale_and_norm_(grads, found, inv)
        ops.update_scale_(scale, trackers, found, 2.0, 0.5, 100, 1, 0.0, 2.0**24)
        return sum_sq

    def args():
        return (
            [torch.ones(4), torch.full((3,), 2.0, dtype=torch.float16)],
            torch.zeros(()),
            torch.tensor(0.5),
            torch.tensor(8.0),
            torch.tensor([0, 1, 0, 0]),
        )

    names = [
        "amp_graph.non_finite_check_.default",
        "amp_graph.non_finite_check_and_unscale_.default",
        "amp_graph.non_finite_check_unscale_and_norm_.default",
        "amp_graph.update_scale_.default",
    ]
    gm = torch.fx.experimental.proxy_tensor.make_fx(step)(*args())
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert [t for t in targets if t.startswith("amp_graph.")] == names

    captured = []

    def backend(graph_module, example_inputs):
        captured.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    eager_args, compiled_args = args(), args()
    expected = step(*eager_args)
    assert torch.equal(compiled(*compiled_args), expected)
    for a, b in zip(
        torch.utils._pytree.tree_leaves(compiled_args),
        torch.utils._pytree.tree_leaves(eager_args),
        strict=True,
    ):
        assert torch.equal(a, b)
    (graph,) = captured
    calls = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert [c for c in calls if "amp_graph" in str(c)] == [
        torch.ops.amp_graph.non_finite_check_.default,
        torch.ops.amp_graph.non_finite_check_and_unscale_.default,
        torch.ops.amp_graph.non_finite_check_unscale_and_norm_.default,
        torch.ops.amp_graph.update_scale_.default,
    ]


def test_build_is_keyed_by_architecture() -> None:
    """The JIT cache name carries the torch build and every visible architecture, and the nvcc
    flags compile exactly those (plus PTX of the newest)."""
    h100 = cuda_extension.build_options("2.11.0+cu130", [(9, 0)])
    assert h100["name"] == "amp_graph_kernels_torch2_11_0_cu130_sm90"
    assert "-gencode=arch=compute_90,code=sm_90" in h100["extra_cuda_cflags"]
    assert "-gencode=arch=compute_90,code=compute_90" in h100["extra_cuda_cflags"]
    mixed = cuda_extension.build_options("2.11.0+cu130", [(9, 0), (8, 0), (9, 0)])
    assert mixed["name"] == "amp_graph_kernels_torch2_11_0_cu130_sm80_sm90"
    flags = [f for f in mixed["extra_cuda_cflags"] if "arch" in f]
    assert flags == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90",
    ]
    assert cuda_extension.build_options("2.11.0+cu130", [(10, 0)])["name"] != h100["name"]
    assert "--use_fast_math" not in h100["extra_cuda_cflags"]


def test_load_extension_builds_for_the_visible_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """load_extension on a (faked) machine with an H100: the build gets the H100's name and
    flags. cpp_extension.load is stubbed; nothing is compiled."""
    from torch.utils import cpp_extension

    calls = []
    monkeypatch.setattr(cuda_extension, "_status", cuda_extension.ExtensionStatus("not-tried"))
    monkeypatch.setattr(cuda_extension, "_cuda_usable", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
    module = types.SimpleNamespace(__file__="lib.so")
    monkeypatch.setattr(cuda_extension, "_module", None)
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: calls.append(kwargs) or module)
    monkeypatch.delenv(cuda_extension.DISABLE_ENV, raising=False)
    assert cuda_extension.python_entry() is None
    assert cuda_extension.load_extension() is True
    (kwargs,) = calls
    assert kwargs["name"].endswith("_sm90")
    assert "-gencode=arch=compute_90,code=sm_90" in kwargs["extra_cuda_cflags"]
    assert kwargs["is_python_module"] is True  # python_entry.cpp's module
    assert cuda_extension.extension_status() == cuda_extension.ExtensionStatus("loaded", "lib.so")
    assert cuda_extension.python_entry() is module


def test_cpu_only_machine_never_builds() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    ops.non_finite_check_([torch.ones(3)], torch.zeros(()))
    assert cuda_extension.extension_status().state == "unavailable"
    assert cuda_extension.load_extension() is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_extension_builds_and_matches_torch_op() -> None:
    """On a GPU machine the extension must build (nvcc + ninja present) and be used."""
    grads = [
        torch.randn(n, device="cuda").to(dt)
        for n, dt in [(1000, torch.float32), (77, torch.float16), (5, torch.bfloat16)]
    ]
    # torch's CUDA op has no bfloat16 kernel: its CPU op is the reference for that one
    theirs = [g.clone() if g.dtype != torch.bfloat16 else g.cpu() for g in grads]
    found, their_found = torch.zeros((), device="cuda"), torch.zeros((), device="cuda")
    inv = torch.tensor(1 / 3, device="cuda")
    ops.non_finite_check_and_unscale_(grads, found, inv)
    assert cuda_extension.extension_status().state == "loaded", (
        cuda_extension.extension_status().detail
    )
    on_cuda = [t for t in theirs if t.is_cuda]
    torch._amp_foreach_non_finite_check_and_unscale_(on_cuda, their_found, inv)
    on_cpu = [t for t in theirs if not t.is_cuda]
    torch._amp_foreach_non_finite_check_and_unscale_(on_cpu, torch.zeros(()), inv.cpu())
    for a, b in zip(grads, theirs, strict=True):
        assert torch.equal(a.cpu(), b.cpu())
    assert found.item() == their_found.item() == 0.0
