"""The short paths a training step takes on the host answer as the long ones would: the
capture cache's answer to a call like the last one, the gradient check's partition of plain
gradients, and the guard's question about fused SGD's momentum buffers."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn as nn

import amp_graph
from amp_graph.demo import models
from amp_graph.scaler import NonFiniteGuard, grad_check, nonfinite_guard
from amp_graph.scaler.grad_check import GradientCheck

# ---- the capture cache ----------------------------------------------------------------------


def _full_lookup(cache, args: tuple):
    """What the cache answers without remembering the last call."""
    last = cache._last
    cache._last = None
    try:
        return cache.get(args, {})[0]
    finally:
        cache._last = last


def test_a_call_like_the_last_one_gets_the_graph_the_full_lookup_gives():
    torch.manual_seed(0)
    model = models.MLP()
    compiled = amp_graph.compile(model, policy="O1", dtype=torch.bfloat16)
    x = torch.randn(8, 64)
    calls = [
        x,  # capture (static sizes)
        x.clone(),  # the same properties: the remembered graph, no flattening
        torch.randn(5, 64),  # new sizes: a capture with symbolic sizes
        x,  # sizes of the first: the symbolic graph, as the full lookup says
        x.to(torch.bfloat16),  # a new dtype: a new signature
        x,
    ]
    for args in calls:
        compiled(args)
        cache = compiled._cache
        got = compiled._last
        with mock.patch("amp_graph.frontends.capture_cache.pytree.tree_flatten") as flatten:
            again, _ = cache.get((args,), {})
        assert again is got
        assert not flatten.called  # a repeat of the last call
        assert _full_lookup(cache, (args,)) is got
    model.eval()  # the training flags are part of the signature
    compiled(x)
    assert compiled._last is _full_lookup(compiled._cache, (x,))
    assert compiled._last.graph_module is not None
    assert len(compiled._cache.captures) >= 3


def test_a_call_with_other_than_plain_tensors_takes_the_full_lookup():
    model = models.MLP()
    compiled = amp_graph.compile(model, policy="O1", dtype=torch.bfloat16)
    weight = nn.Parameter(torch.randn(8, 64))  # a tensor subclass: not a plain tensor
    compiled(weight)
    with mock.patch(
        "amp_graph.frontends.capture_cache.pytree.tree_flatten",
        wraps=amp_graph.frontends.capture_cache.pytree.tree_flatten,
    ) as flatten:
        compiled(weight)
    assert flatten.called


# ---- the gradient check's partitions --------------------------------------------------------


def _optimizer_with_grads(*grads: torch.Tensor) -> torch.optim.Optimizer:
    params = [nn.Parameter(torch.zeros(g.shape, dtype=g.dtype, device=g.device)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    return torch.optim.SGD(params, lr=0.1)


def _long_way(optimizer, allow_fp16: bool):
    with mock.patch.object(grad_check, "_plain_partition", return_value=None):
        return GradientCheck().collect(optimizer, allow_fp16=allow_fp16)


@pytest.mark.parametrize("dtypes", [[torch.float32], [torch.float32, torch.bfloat16]])
def test_plain_gradients_are_partitioned_as_the_long_way_partitions_them(dtypes):
    grads = [torch.randn(3, 2).to(d) for d in dtypes] + [torch.randn(4).to(dtypes[-1])]
    opt = _optimizer_with_grads(*grads)
    opt.param_groups[0]["params"][0].grad = None  # a parameter without a gradient
    short = GradientCheck().collect(opt, allow_fp16=False)
    long = _long_way(opt, allow_fp16=False)
    assert [(p.device, p.groups, p.partial) for p in short] == [
        (p.device, p.groups, p.partial) for p in long
    ]
    assert [[id(g) for g in p.grads] for p in short] == [[id(g) for g in p.grads] for p in long]


@pytest.mark.parametrize(
    "odd",
    [
        lambda: torch.randn(4).to_sparse(),
        lambda: torch.randn(4, device="meta"),  # another device
        lambda: torch.randn(4).as_subclass(_Marked),  # a tensor subclass
    ],
)
def test_a_gradient_that_needs_bookkeeping_takes_the_long_way(odd):
    grads = [torch.randn(4), odd()]
    assert grad_check._plain_partition(grads, allow_fp16=True) is None


def test_a_float16_gradient_still_raises_where_it_is_refused():
    opt = _optimizer_with_grads(torch.randn(4), torch.randn(4).half())
    grads = [p.grad for p in opt.param_groups[0]["params"]]
    assert grad_check._plain_partition(grads, allow_fp16=False) is None
    with pytest.raises(ValueError):
        GradientCheck().collect(opt, allow_fp16=False)
    assert len(GradientCheck().collect(opt, allow_fp16=True)) == 1


class _Marked(torch.Tensor):
    pass


# ---- fused SGD's momentum buffers -----------------------------------------------------------


def _by_tensor_key(optimizer: torch.optim.Optimizer) -> bool:
    """The question asked with tensor keys (the definition the by-id lookup must match)."""
    if not isinstance(optimizer, torch.optim.SGD):
        return False
    state = optimizer.state
    return any(
        group["momentum"] != 0 and p.grad is not None and "momentum_buffer" not in state.get(p, {})
        for group in optimizer.param_groups
        for p in group["params"]
    )


def test_the_momentum_buffer_question_answers_as_with_tensor_keys():
    torch.manual_seed(0)
    model = models.MLP()
    frozen = nn.Linear(4, 4)
    opt = torch.optim.SGD(
        [
            {"params": list(model.parameters()), "momentum": 0.9},
            {"params": list(frozen.parameters()), "momentum": 0.0},
        ],
        lr=0.1,
        fused=True,
    )
    guard = NonFiniteGuard()
    x, y = torch.randn(4, 64), torch.randint(0, 10, (4,))
    answers = []
    for step in range(4):
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x) + frozen(torch.ones(4)).sum(), y).backward()
        if step == 2:  # a parameter gets a gradient for the first time: its buffer is missing
            extra = nn.Parameter(torch.ones(3))
            opt.add_param_group({"params": [extra], "momentum": 0.9})
            extra.grad = torch.ones(3)
        answers.append(nonfinite_guard._allocates_uninitialized_state(opt))
        assert answers[-1] == _by_tensor_key(opt)
        guard.check(opt)
        guard.step(opt)
        guard.end_step()
        assert bool(guard.last_step_taken)
    assert answers == [True, False, True, False]
    assert not nonfinite_guard._allocates_uninitialized_state(torch.optim.Adam([extra]))
