"""autopolicy and node overrides on the fp8 policy, whose pass renames what it converts.

The fp8 pass replaces a captured ``linear`` by ``linear_fp8`` fed by ``<value>_e4m3``
quantizations; node overrides name the captured graph's nodes. autopolicy must demote fp8
layers by their captured names (it had proposed ``linear_2_fp8``, which its own capture
refused), trace an fp8 quantization's error to the linear it feeds (it had given up with
"no node left to demote"), and an override naming ``linear_fp8`` must say which name to use.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_graph

BF16 = torch.bfloat16


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16)
    )


def samples() -> list[tuple[torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(16, 32, generator=gen),) for _ in range(2)]


def fp8_nodes(compiled: amp_graph.CompiledModule) -> set[str]:
    gm = compiled.graph_module
    return {n.name for n in gm.graph.nodes if n.target is torch.ops.amp_graph.fp8_linear.default}


def test_gradient_search_demotes_fp8_linears_by_their_captured_names() -> None:
    model, inputs = mlp(), samples()
    target = torch.randint(0, 16, (16,), generator=torch.Generator().manual_seed(4))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.float(), target)

    policy = amp_graph.autopolicy(model, "fp8", BF16, sample_inputs=inputs, loss_fn=loss_fn)
    assert policy.nodes and not any(name.endswith("_fp8") for name in policy.nodes)
    compiled = amp_graph.compile(model, policy, BF16)
    compiled(*inputs[0])
    demoted = {f"{name}_fp8" for name in policy.nodes}
    assert fp8_nodes(compiled) and not fp8_nodes(compiled) & demoted  # the rest stay fp8
    # what autopolicy promises: every parameter's gradient within tol of float32's
    result = amp_graph.numerics(compiled, *inputs[0], backward=True, loss_fn=loss_fn)
    tol = 10 * torch.finfo(BF16).eps
    assert all(p.grad.rel_error <= tol for p in result.params)


def test_forward_search_traces_a_quantization_to_the_linear_it_feeds() -> None:
    model, inputs = mlp(), samples()
    policy = amp_graph.autopolicy(model, "fp8", BF16, sample_inputs=inputs, tol=0.01)
    assert policy.nodes and not any(name.endswith(("_fp8", "_e4m3")) for name in policy.nodes)
    compiled = amp_graph.compile(model, policy, BF16)
    result = amp_graph.numerics(compiled, *inputs[0])
    assert max(o.rel_error for o in result.outputs) <= 0.01


def test_a_node_override_naming_the_fp8_linear_says_which_name_to_use() -> None:
    policy = amp_graph.Policy.preset("fp8").override(nodes={"linear_fp8": "fp32"})
    with pytest.raises(ValueError, match=r"fp8 pass makes of node 'linear'.*nodes=\{'linear'"):
        amp_graph.compile(mlp(), policy, BF16)(*samples()[0])
