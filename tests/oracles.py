"""The references compiled models are held to: torch.autocast, run by torch itself.

* :func:`cuda_autocast_mismatches`: policy O1 must give every aten op of a whole model the
  dtype CUDA autocast gives it. The oracle runs the compiled graph's ops (with the casts
  amp_graph inserted skipped, so each op sees what the model gave it) on fake CUDA
  tensors under ``torch.autocast("cuda")`` — torch's own AutocastCUDA kernels, no GPU —
  entering, for the nodes inside the model's own autocast blocks, the state those blocks
  set. Each op's output dtype is compared with the plan's.
* :func:`assert_bitwise_cpu_autocast`: policy ``"autocast"`` on CPU must give outputs equal,
  bit for bit, to the model run under ``torch.autocast("cpu")``.
* :func:`check_training_step`: gradients arrive in float32, finite, and the loss is close
  to the float32 model's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx as fx
from amp_graph.passes import AMP, REGION, Role
from op_samples import cuda_autocast
from torch.utils import _pytree as pytree

import amp_graph

_CASTS = ("aten::to", "aten::_to_copy", "aten::type_as")


def _to_fake_cuda(value: Any, mode: Any) -> Any:
    if isinstance(value, torch.Tensor):
        with mode:
            return torch.empty_strided(
                tuple(value.shape), value.stride(), dtype=value.dtype, device="cuda"
            )
    if isinstance(value, torch.device) and value.type == "cpu":
        return torch.device("cuda")
    return value


def _to_fake_cuda_tree(value: Any, mode: Any) -> Any:
    return pytree.tree_map(lambda v: _to_fake_cuda(v, mode), value)


class _CudaAutocastRun(fx.Interpreter):
    """Runs a compiled graph's ops under CUDA autocast on fake CUDA tensors, skipping the
    casts amp_graph inserted; records each node's output dtypes."""

    def __init__(self, gm: fx.GraphModule, low: torch.dtype, mode: Any) -> None:
        super().__init__(gm)
        self.low, self.mode = low, mode
        self.dtypes: dict[str, Any] = {}
        self.unverified: list[str] = []

    def run_node(self, n: fx.Node) -> Any:
        amp = n.meta[AMP]
        if amp.role is Role.CAST:
            return self.env[n.args[0]]
        if n.op == "get_attr":
            return _to_fake_cuda(super().run_node(n), self.mode)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        args = pytree.tree_map(lambda v: _to_fake_cuda(v, self.mode), args)
        kwargs = pytree.tree_map(lambda v: _to_fake_cuda(v, self.mode), kwargs)
        if n.op in ("placeholder", "output"):
            return super().run_node(n)
        region = n.meta.get(REGION)
        state = (
            cuda_autocast(region.dtype, region.enabled)
            if region is not None
            else contextlib.nullcontext()
        )
        with self.mode, state:
            try:
                out = self._call(n, args, kwargs)
            except (RuntimeError, NotImplementedError, AssertionError, ValueError) as error:
                # No meta kernel for this op (e.g. aten::_thnn_fused_gru_cell): CUDA
                # autocast's answer is unknown here; carry the plan's value on.
                self.unverified.append(f"{n.name} ({type(error).__name__})")
                return _to_fake_cuda_tree(n.meta.get("val"), self.mode)
        self.dtypes[n.name] = pytree.tree_map(
            lambda v: v.dtype if isinstance(v, torch.Tensor) else None, out
        )
        return out

    def _call(self, n: fx.Node, args: tuple, kwargs: dict) -> Any:
        target = n.target
        if isinstance(target, torch._ops.OpOverload) and target._schema.name in _CASTS:
            # x.to(device, dtype): the dtype is what matters; moving fakes between devices
            # needs a CUDA build.
            dtype = kwargs.get("dtype") or next(
                (a for a in args[1:] if isinstance(a, torch.dtype)), None
            )
            if target._schema.name == "aten::type_as":
                dtype = args[1].dtype
            return args[0].to(dtype) if dtype is not None else args[0]
        try:
            return getattr(self, n.op)(target, args, kwargs)
        except (RuntimeError, ValueError):
            # fake CUDA kernels may lay out outputs differently (flash attention's
            # transposed output): a view of it then fails where the real one would not.
            contiguous = pytree.tree_map(
                lambda v: (
                    torch.ops.aten.contiguous.default(v) if isinstance(v, torch.Tensor) else v
                ),
                args,
            )
            return getattr(self, n.op)(target, contiguous, kwargs)


def cuda_autocast_mismatches(
    compiled: Any, inputs: tuple, kwargs: dict | None = None, unverifiable: tuple[str, ...] = ()
) -> list[str]:
    """Nodes whose planned output dtype differs from CUDA autocast's, as readable lines.

    Ops fake CUDA tensors cannot run (no meta kernel) must be named in ``unverifiable``
    (by aten op name); any other op that could not run is reported as a mismatch too.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    gm = amp_graph.frontends.compiler.as_graph_module(compiled)
    record = gm.meta["amp_graph"]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    if getattr(compiled, "in_spec", None) is not None:
        flat = pytree.tree_leaves((inputs, kwargs or {}))
    else:
        flat = pytree.tree_leaves((inputs, kwargs or {}))
    fake = [_to_fake_cuda(v, mode) for v in flat]
    runner = _CudaAutocastRun(gm, record.dtype, mode)
    with cuda_autocast(record.dtype):
        runner.run(*fake)
    mismatches = [
        f"{entry}: could not run on fake CUDA tensors"
        for entry in runner.unverified
        if not any(op in entry for op in unverifiable)
    ]
    for node in gm.graph.nodes:
        amp = node.meta[AMP]
        if (
            amp.role not in (Role.OP, Role.USER_CAST, Role.INPLACE)
            or node.name not in runner.dtypes
            or amp.source == "cpu"  # planned for this CPU, which lacks the low kernel
        ):
            continue
        ours = amp.out_dtype
        theirs = runner.dtypes[node.name]
        if _floating_leaves(ours) != _floating_leaves(theirs):
            mismatches.append(
                f"{node.name} ({amp.op}, module {amp.module_path!r}, {amp.source}: {amp.detail}): "
                f"amp_graph {ours}, CUDA autocast {theirs}"
            )
    return mismatches


def _floating_leaves(tree: Any) -> list[torch.dtype]:
    leaves = tree if isinstance(tree, (tuple, list)) else [tree]
    flat: list[Any] = []
    for leaf in leaves:
        flat.extend(_floating_leaves(leaf) if isinstance(leaf, (tuple, list)) else [leaf])
    return [d for d in flat if isinstance(d, torch.dtype) and d.is_floating_point]


def assert_outputs_equal(ours: Any, theirs: Any, what: str) -> None:
    ours_leaves, theirs_leaves = pytree.tree_leaves(ours), pytree.tree_leaves(theirs)
    assert len(ours_leaves) == len(theirs_leaves), what
    for i, (a, b) in enumerate(zip(ours_leaves, theirs_leaves, strict=True)):
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype, f"{what}: output {i} is {a.dtype}, autocast {b.dtype}"
            assert torch.equal(a, b), (
                f"{what}: output {i} differs from torch.autocast by "
                f"{(a.double() - b.double()).abs().max().item()}"
            )


def assert_bitwise_cpu_autocast(
    model: torch.nn.Module, inputs: tuple, kwargs: dict | None = None, seed: int = 0
) -> None:
    """policy="autocast" on CPU gives torch.autocast's outputs, bit for bit (same RNG)."""
    kwargs = kwargs or {}
    compiled = amp_graph.compile(model, "autocast", check_each_pass=True)
    torch.manual_seed(seed)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            theirs = model(*inputs, **kwargs)
    except RuntimeError as error:
        # The oracle cannot run here: CPU autocast sends LSTM to oneDNN's bf16 kernel, which
        # CPUs without bf16 instructions lack. The compiled graph (bf16 inputs, so torch's
        # own kernel) must still run and give finite values; the comparison needs such a CPU.
        ours = compiled(*inputs, **kwargs)
        leaves = [v for v in pytree.tree_leaves(ours) if isinstance(v, torch.Tensor)]
        assert leaves and all(torch.isfinite(v.float()).all() for v in leaves)
        pytest.skip(f"torch.autocast cannot run {type(model).__name__} on this CPU: {error}")
    torch.manual_seed(seed)
    ours = compiled(*inputs, **kwargs)
    assert_outputs_equal(ours, theirs, type(model).__name__)


def check_training_step(
    model: torch.nn.Module,
    inputs: tuple,
    loss_of: Callable[[Any], torch.Tensor],
    policy: str = "O1",
    kwargs: dict | None = None,
    rtol: float = 0.05,
) -> None:
    """One forward/backward: float32 finite gradients on every trained parameter, and a loss
    within ``rtol`` of the float32 model's."""
    kwargs = kwargs or {}
    torch.manual_seed(0)
    reference = loss_of(model(*inputs, **kwargs)).float()
    model.zero_grad(set_to_none=True)
    compiled = amp_graph.compile(model, policy, check_each_pass=True)
    torch.manual_seed(0)
    loss = loss_of(compiled(*inputs, **kwargs))
    loss.float().backward()
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with_grads = [(n, p) for n, p in trained if p.grad is not None]
    assert with_grads, "no parameter received a gradient"
    for name, param in with_grads:
        assert param.grad.dtype == torch.float32, f"{name}: gradient is {param.grad.dtype}"
        assert torch.isfinite(param.grad).all(), f"{name}: non-finite gradient"
    assert torch.allclose(loss.float(), reference, rtol=rtol), (
        f"loss {loss.item()} vs float32 {reference.item()}"
    )
