"""Policy O1 on torch's own autocast test cases, captured on the CPU.

``torch.testing._internal.autocast_test_lists.AutocastTestLists`` holds the cases torch's
CUDA autocast tests run (``test/test_cuda.py``): each op with arguments of mixed or
single dtypes, grouped by what CUDA autocast must do with them (lower precision, float32,
promote to the widest input, builtin promotion). Every case (its float16 inputs as written,
and again as bfloat16) is captured by
``amp_graph.compile`` (torch.export on the CPU) under O1, and every op of the captured
graph must compute at the dtype CUDA autocast's own kernels give it on fake CUDA tensors
(tests/oracles.py), and the graph must return what CUDA autocast returns. Where the op runs
on the CPU, the compiled output equals the op run on its inputs cast as CUDA autocast
casts them.

None of them may be refused: O1 is CUDA autocast on every device, and the capture must
not be held to CPU autocast's narrower lists.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from op_samples import cuda_autocast_output
from oracles import cuda_autocast_mismatches
from torch.utils import _pytree as pytree

import amp_graph

autocast_test_lists = pytest.importorskip(
    "torch.testing._internal.autocast_test_lists",
    reason="torch's test lists import expecttest (pip install expecttest; in the dev extra)",
)

# Lists of ops that compute in the low dtype (the others compute in float32, or promote).
_LOW_LISTS = ("torch_fp16", "nn_fp16", "linalg_fp16", "methods_fp16")
_LISTS = (
    "torch_expect_builtin_promote",
    "methods_expect_builtin_promote",
    "torch_fp16",
    "torch_fp32",
    "torch_need_autocast_promote",
    "nn_fp16",
    "nn_fp32",
    "linalg_fp16",
    "methods_fp16",
    "methods_fp32",
)
# cuDNN ops exist in every build's Python API but have no CPU or meta kernel: no fake
# CUDA tensor can run them either, so no oracle can say what they return.
_NO_KERNEL = frozenset({"cudnn_convolution", "cudnn_convolution_transpose"})
# torch.equal returns a Python bool computed from the values: no graph holds it, and there
# is nothing to cast (torch's test checks its builtin promotion, not autocast's).
_NO_GRAPH = frozenset({"equal"})


def _namespace(list_name: str) -> Any:
    if list_name.startswith("nn"):
        return torch._C._nn
    if list_name.startswith("linalg"):
        return torch._C._linalg
    return torch


class _Call(nn.Module):
    """One case as a module: its tensor arguments (nested ones too: ``index_put``'s indices,
    ``lstm_cell``'s state) are the module's inputs, everything else is baked in."""

    def __init__(self, fn: Callable | str, args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.fn, self.kwargs = fn, kwargs
        leaves, self.spec = pytree.tree_flatten(args)
        self.layout = [None if isinstance(v, torch.Tensor) else v for v in leaves]

    def call(self, *tensors: torch.Tensor) -> Any:
        it = iter(tensors)
        leaves = [next(it) if v is None else v for v in self.layout]
        args = pytree.tree_unflatten(leaves, self.spec)
        if isinstance(self.fn, str):  # a Tensor method: the first argument is self
            return getattr(args[0], self.fn)(*args[1:], **self.kwargs)
        return self.fn(*args, **self.kwargs)

    def forward(self, *tensors: torch.Tensor) -> Any:
        return self.call(*tensors)


def _cases() -> list[Any]:
    lists = autocast_test_lists.AutocastTestLists("cpu")
    found = []
    for list_name in _LISTS:
        for index, entry in enumerate(getattr(lists, list_name)):
            op, args = entry[0], entry[1]
            extra = entry[2] if len(entry) > 2 else None
            kwargs = extra if isinstance(extra, dict) else {}
            # test_cuda.py reads a third element that is not a dict (or a dtype) as "skip
            # this case" (TEST_WITH_ROCM; einsum's stray operand tuple is truthy too)
            skipped_by_torch = extra is not None and not isinstance(extra, (dict, torch.dtype))
            if skipped_by_torch or op in _NO_KERNEL or op in _NO_GRAPH:
                continue
            for low in (
                torch.float16,
                torch.bfloat16,
            ):  # test_cuda.py's float16 inputs as given, and as bfloat16
                expected = _expected(list_name, low, extra)
                label = f"{list_name}-{op}-{index}-{str(low).removeprefix('torch.')}"
                found.append(pytest.param(list_name, op, args, kwargs, low, expected, id=label))
    return found


def _expected(list_name: str, low: torch.dtype, extra: Any) -> torch.dtype:
    """What torch's test expects the op to return (test_cuda.py's reading of the lists)."""
    if list_name.endswith("expect_builtin_promote"):
        return extra
    if list_name in _LOW_LISTS:
        return low
    return torch.float32  # the fp32 lists, and promote of low with float32 inputs


def _module(list_name: str, op: str, args: tuple, kwargs: dict) -> tuple[_Call, tuple]:
    fn = op if list_name.startswith("methods") else getattr(_namespace(list_name), op)
    tensors = tuple(v for v in pytree.tree_leaves(args) if isinstance(v, torch.Tensor))
    return _Call(fn, args, kwargs), tensors


def _as_low(tensors: tuple, low: torch.dtype) -> tuple:
    """The lists write their low inputs in float16; a bfloat16 run gets them in bfloat16."""
    return tuple(t.to(low) if t.dtype == torch.float16 else t for t in tensors)


@pytest.mark.parametrize(("list_name", "op", "args", "kwargs", "low", "expected"), _cases())
def test_o1_agrees_with_cuda_autocast_on_torch_test_lists(
    list_name: str, op: str, args: tuple, kwargs: dict, low: torch.dtype, expected: torch.dtype
) -> None:
    module, tensors = _module(list_name, op, args, kwargs)
    tensors = _as_low(tensors, low)
    compiled = amp_graph.compile(module, "O1", low)
    out = compiled(*tensors)  # captures (torch.export on the CPU), rewrites and runs
    ours = [v.dtype for v in pytree.tree_leaves(out) if isinstance(v, torch.Tensor)]
    # torch's own expectation for the case
    assert ours[0] == expected, f"{op}: amp_graph returns {ours}, torch's test expects {expected}"

    # every op of the graph, against CUDA autocast's kernels on fake CUDA tensors; a few
    # (the fused GRU cell, grid_sampler) have no kernel fake CUDA tensors can run, and
    # torch's expectation above is then the oracle
    mismatches = cuda_autocast_mismatches(compiled, tensors)
    assert not [m for m in mismatches if "could not run" not in m], "\n".join(mismatches)
    if not mismatches:
        theirs = cuda_autocast_output(module.call, tensors, low)
        theirs = [v.dtype for v in pytree.tree_leaves(theirs) if isinstance(v, torch.Tensor)]
        assert ours == theirs, f"{op}: amp_graph returns {ours}, CUDA autocast {theirs}"

    # the numbers: the op run on its inputs cast as CUDA autocast casts them
    reference = _reference(module, tensors, expected, list_name)
    if reference is not None:
        torch.testing.assert_close(
            pytree.tree_leaves(out)[0], reference, rtol=0, atol=0, equal_nan=True
        )


def _reference(module: _Call, tensors: tuple, dtype: torch.dtype, list_name: str) -> Any:
    """The op on its floating inputs cast to ``dtype`` (None where the CPU has no kernel at
    that dtype, or for builtin promotion, which casts nothing)."""
    if list_name.endswith("expect_builtin_promote") or not dtype.is_floating_point:
        return None
    cast = tuple(
        t.to(dtype) if t.dtype in (torch.float16, torch.bfloat16, torch.float32) else t
        for t in tensors
    )
    try:
        return pytree.tree_leaves(module.call(*cast))[0]
    except (RuntimeError, NotImplementedError) as error:
        if "not implemented for" in str(error):
            return None
        raise
