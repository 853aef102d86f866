"""Ops defined with ``torch.library.Library`` compute what eager torch.autocast computes.

Before ``torch.library.custom_op`` an op was defined as a schema and a kernel per dispatch key
(``lib.define`` + ``lib.impl``, or ``torch.library.define`` + ``@torch.library.impl``); vLLM's
``direct_register_custom_op`` still does so. Under eager torch.autocast the Python kernel
runs with autocast on: its matmul computes in bf16, also on a bf16 activation and a float32
weight. A captured graph calls its ops with autocast off, so before amp_graph kept these ops
the kernel computed in float32, silently, or failed on mixed dtypes at run time.

torch.autocast in eager mode is the oracle: outputs and gradients bit for bit (the gradients
flow through torch's autograd fallback, which differentiates the ops the kernel calls), and
what the kernel computes in at run time. Paths: ``compile`` (``mode="eager"`` and inductor's
``"default"``), the backend (inductor where no gradient flows through the op, a refusal by
name where one does, ``inner="eager"`` either way), ``export`` (a refusal by name).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import amp_graph
from amp_graph.capture import CaptureError
from amp_graph.capture.autograd_functions import function_calls
from amp_graph.capture.library_ops import is_library_op

BF16 = torch.bfloat16
NS = "amp_graph_library_ops_test"

# the dtype each real (not fake) run of a kernel computed its product in
KERNEL_DTYPES: list[torch.dtype] = []


def _product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = x @ w.t()
    if not isinstance(y, torch._subclasses.fake_tensor.FakeTensor):
        KERNEL_DTYPES.append(y.dtype)
    return y


def _fake_product(x, w):
    # written without autocast in mind, as such fakes are: float32 where the kernel gives bf16
    return x.new_empty((*x.shape[:-1], w.shape[0]))


# vLLM's style: a Library, a schema, a CPU kernel, a fake
LIB = torch.library.Library(NS, "DEF")
LIB.define("proj(Tensor x, Tensor w) -> Tensor")
LIB.impl("proj", _product, "CPU")
torch.library.register_fake(f"{NS}::proj", _fake_product, lib=LIB)

# one kernel for every device
LIB.define("proj_any_device(Tensor x, Tensor w) -> Tensor")
LIB.impl("proj_any_device", _product, "CompositeExplicitAutograd")
torch.library.register_fake(f"{NS}::proj_any_device", _fake_product, lib=LIB)

# a composite: export's pre-dispatch capture keeps it as one op
LIB.define("proj_composite(Tensor x, Tensor w) -> Tensor")
LIB.impl("proj_composite", lambda x, w: x @ w.t(), "CompositeImplicitAutograd")


def _accumulate_product(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    out.add_(x @ w.t())


# the result written into a buffer
LIB.define("accumulate_proj(Tensor(a!) out, Tensor x, Tensor w) -> ()")
LIB.impl("accumulate_proj", _accumulate_product, "CPU")
torch.library.register_fake(f"{NS}::accumulate_proj", lambda out, x, w: None, lib=LIB)

# the older functions: torch.library.define and @torch.library.impl
torch.library.define(f"{NS}_old::proj", "(Tensor x, Tensor w) -> Tensor")
torch.library.impl(f"{NS}_old::proj", "cpu")(_product)
torch.library.register_fake(f"{NS}_old::proj")(_fake_product)

OPS = {
    "library": torch.ops.amp_graph_library_ops_test.proj,
    "composite_explicit": torch.ops.amp_graph_library_ops_test.proj_any_device,
    "define_and_impl": torch.ops.amp_graph_library_ops_test_old.proj.default,
}


class LinearThenOp(nn.Module):
    """A bf16 activation and a float32 weight into the op (mixed inputs)."""

    def __init__(self, op) -> None:
        super().__init__()
        self.op = op
        self.fc = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return torch.tanh(self.op(self.fc(x), self.w))


class OpOnFloat32(nn.Module):
    """The op on float32 values only; mse_loss computes in float32 under autocast and O1,
    so the plan must know the op's value is bf16 to cast it."""

    def __init__(self, op) -> None:
        super().__init__()
        self.op = op
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        y = self.op(x, self.w)
        return nn.functional.mse_loss(y, torch.zeros_like(y), reduction="none")


class WritesIntoBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        out = torch.zeros(x.shape[0], 8)
        torch.ops.amp_graph_library_ops_test.accumulate_proj(out, self.fc(x), self.w)
        return out


def _step(model, x, autocast: bool, owner=None):
    """Output, ``owner``'s (default ``model``'s) parameter gradients and the input's gradient
    of one forward and backward, and the dtypes the kernel computed in."""
    x = x.detach().clone().requires_grad_()
    KERNEL_DTYPES.clear()
    with warnings.catch_warnings():
        # torch's autograd fallback warns that the op has no autograd kernel, in both runs
        warnings.filterwarnings("ignore", message=".*autograd kernel was not registered")
        with torch.autocast("cpu", BF16, enabled=autocast):
            out = model(x)
        out.float().sum().backward()
    grads = {n: p.grad for n, p in (owner or model).named_parameters()}
    return (out, grads, x.grad), list(KERNEL_DTYPES)


def _assert_bitwise(got, want):
    (out, grads, x_grad), (want_out, want_grads, want_x_grad) = got, want
    assert out.dtype == want_out.dtype
    assert torch.equal(out, want_out)
    assert torch.equal(x_grad, want_x_grad)
    for name, grad in want_grads.items():
        assert grads[name] is not None and torch.equal(grads[name], grad), name


def _model_and_reference(model_type, op):
    torch.manual_seed(0)
    model = model_type(op)
    return model, copy.deepcopy(model), torch.randn(4, 8)


@pytest.mark.parametrize("policy", ["autocast", "O1"])
@pytest.mark.parametrize("model_type", [LinearThenOp, OpOnFloat32])
@pytest.mark.parametrize("style", list(OPS))
def test_a_library_op_computes_what_torch_autocast_gives_it_bit_for_bit(style, model_type, policy):
    model, reference, x = _model_and_reference(model_type, OPS[style])
    want, want_kernel = _step(reference, x, autocast=True)
    assert want_kernel == [BF16]
    compiled = amp_graph.compile(model, policy, BF16)
    got, kernel = _step(compiled, x, autocast=False, owner=model)
    assert kernel == [BF16]  # the kernel ran under autocast, once
    _assert_bitwise(got, want)
    kept = function_calls(compiled.graph_module)
    assert len(kept) == 1 and "proj" in kept[0].target.name


def test_a_composite_library_op_is_kept_under_autocast_too():
    model, reference, x = _model_and_reference(
        LinearThenOp, torch.ops.amp_graph_library_ops_test.proj_composite
    )
    want, _ = _step(reference, x, autocast=True)
    compiled = amp_graph.compile(model, "autocast", BF16)
    got, _ = _step(compiled, x, autocast=False, owner=model)
    _assert_bitwise(got, want)
    assert len(function_calls(compiled.graph_module)) == 1


# namespaces torch 2.13-2.15 and amp_graph define ops in from Python
TORCH_NAMESPACES_SEEN = {
    "_dtensor",
    "_inductor_test",
    "_native",
    "amp_graph",
    "c10d_functional",
    "coor",
    "debugprims",
    "export",
    "fsdp",
    "pippy",
    "prims",
    "quantized_decomposed",
    "symm_mem",
}


def test_only_the_users_python_defined_ops_count():
    # torch's own Python-defined ops: FSDP2's, DTensor's, the functional collectives', the
    # quantization's; prims; amp_graph's own; a C++ op; a torch.library.custom_op
    import torch.ao.quantization.fx._decomposed
    import torch.distributed._functional_collectives
    import torch.distributed.fsdp
    import torch.distributed.tensor

    counted = {q for q in torch.library._defs if is_library_op(q)}
    assert {f"{NS}::proj", f"{NS}::proj_composite", f"{NS}_old::proj"} <= counted
    # (another library's ops, torchao's where a test imported it, are the user's too)
    torchs = {q for q in counted if q.split("::")[0] in TORCH_NAMESPACES_SEEN}
    assert not torchs
    assert not is_library_op("aten::mm")
    assert not is_library_op("amp_graph_custom_ops_test::scaled_mm")


def test_a_mutating_library_op_whose_kernel_would_multiply_mixed_dtypes_is_refused_by_name():
    compiled = amp_graph.compile(WritesIntoBuffer(), "O1", BF16)
    with pytest.raises(
        CaptureError, match=rf"{NS}::accumulate_proj writes into its inputs.*bf16, fp32 inputs"
    ):
        compiled(torch.randn(4, 8))


def test_compile_with_inductor_runs_a_library_op_under_autocast(fresh_dynamo):
    model, reference, x = _model_and_reference(LinearThenOp, OPS["library"])
    want, _ = _step(reference, x, autocast=True)
    compiled = amp_graph.compile(model, "autocast", BF16, mode="default")
    _step(compiled, x, autocast=False)  # the first call compiles
    model.zero_grad(set_to_none=True)
    got, kernel = _step(compiled, x, autocast=False, owner=model)
    assert kernel == [BF16]
    (out, grads, x_grad), (want_out, want_grads, want_x_grad) = got, want
    assert out.dtype == want_out.dtype and torch.equal(out, want_out)
    # inductor orders the bias gradient's sum its own way
    torch.testing.assert_close(x_grad, want_x_grad, rtol=1.6e-2, atol=1e-2)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1.6e-2, atol=1e-2, msg=name)


def test_the_backend_with_inductor_runs_a_library_op_under_autocast_without_gradients(
    fresh_dynamo,
):
    model, reference, x = _model_and_reference(LinearThenOp, OPS["library"])
    with torch.no_grad(), torch.autocast("cpu", BF16):
        want = reference(x)
    compiled = torch.compile(model, backend=amp_graph.backend("autocast", BF16, inner="inductor"))
    KERNEL_DTYPES.clear()
    with torch.no_grad():
        got = compiled(x)
    assert KERNEL_DTYPES == [BF16]
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_the_backend_with_inductor_refuses_a_gradient_through_a_library_op(fresh_dynamo):
    model, _, x = _model_and_reference(LinearThenOp, OPS["library"])
    compiled = torch.compile(model, backend=amp_graph.backend("autocast", BF16, inner="inductor"))
    with pytest.raises(
        Exception,
        match=rf"gradient flows through the op {NS}::proj .*torch.library.Library.*"
        r"torch.library.custom_op and register_autograd",
    ):
        compiled(x)


def test_the_backend_with_inner_eager_runs_a_library_op_under_autocast(fresh_dynamo):
    model, reference, x = _model_and_reference(LinearThenOp, OPS["library"])
    want, _ = _step(reference, x, autocast=True)
    compiled = torch.compile(model, backend=amp_graph.backend("autocast", BF16, inner="eager"))
    got, kernel = _step(compiled, x, autocast=False, owner=model)
    assert kernel == [BF16]
    _assert_bitwise(got, want)


@pytest.mark.parametrize("model_type", [LinearThenOp, OpOnFloat32])
def test_export_refuses_a_library_op_whose_dtype_autocast_decides(model_type):
    from amp_graph.deploy.custom_op_bodies import AutocastDependentOp

    with pytest.raises(AutocastDependentOp, match=rf"custom op {NS}::proj .*inside its body"):
        amp_graph.export(model_type(OPS["library"]), (torch.randn(4, 8),), policy="O1", dtype=BF16)
