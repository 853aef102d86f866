"""One policy front: a policy means one thing through ``compile``, the backend and ``Graph``.

The three entry points resolve and validate through :mod:`amp_graph.frontends.policy_request`: the
same errors for the same mistakes, the same op dtypes for the same policy, module overrides that
match nothing refused (for a Graph, naming its own path: ``model.head``), one device rule, and
O2's master weights taken from the policy's ``master_weights`` field, not from its name.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from amp_graph.passes import AMP, Role

import amp_graph
from amp_graph.frontends.policy_request import device_type_of
from tests.zoo import GPTConfig, NanoGPT

BF16, FP32 = torch.bfloat16, torch.float32


class TrainGraph(amp_graph.Graph):
    def __init__(self, model: nn.Module, policy, dtype=BF16, lr: float = 0.0) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=lr))
        self.config.enable_amp(True, policy=policy, dtype=dtype)

    def build(self, idx, targets):
        _, loss = self.model(idx, targets)
        loss.backward()
        return loss


def _nanogpt() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = NanoGPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16))
    return model, torch.randint(0, 64, (2, 16))


def _op_dtypes(gm: torch.fx.GraphModule, prefix: str = "") -> Counter:
    """(module path below the model, aten op, compute dtype) of every op node."""
    found: Counter = Counter()
    for node in gm.graph.nodes:
        amp = node.meta[AMP]
        if amp.role is not Role.OP:
            continue
        path = amp.module_path
        if prefix:
            assert path == prefix or path.startswith(f"{prefix}."), path
            path = path[len(prefix) + 1 :]
        found[(path, amp.aten, amp.compute_dtype)] += 1
    return found


@pytest.mark.parametrize(
    "policy",
    [
        "O1",
        "O3",
        amp_graph.Policy.preset("O1").override(modules={"**attn": "fp32"}),
        amp_graph.Policy.preset("O3").override(ops={"gelu": "fp32"}),
    ],
    ids=["O1", "O3", "O1-attn-pinned", "O3-gelu-op-override"],
)
def test_a_policy_gives_the_same_op_dtypes_through_compile_backend_and_graph(
    policy, fresh_dynamo
) -> None:
    model, idx = _nanogpt()
    compiled = amp_graph.compile(model, policy, BF16, example_inputs=(idx, idx))
    reference = _op_dtypes(amp_graph.frontends.compiler.as_graph_module(compiled))
    assert reference

    dynamo = torch.compile(model, backend=amp_graph.backend(policy, BF16, inner="eager"))
    dynamo(idx, idx)
    [backend_gm] = amp_graph.captured_graphs(dynamo)
    assert _op_dtypes(backend_gm) == reference

    graph = TrainGraph(model, policy)
    graph(idx, idx)
    assert _op_dtypes(graph.build_graph, prefix="model") == reference
    if not isinstance(policy, str) and policy.modules:  # the pin did something
        pinned = [k for k in reference if ".attn" in k[0] and k[1] == "linear"]
        assert pinned and {k[2] for k in pinned} == {FP32}


def test_graph_refuses_a_module_path_that_matches_nothing_naming_its_own_path() -> None:
    model, idx = _nanogpt()
    policy = amp_graph.Policy.preset("O1").override(modules={"lm_head": "fp32"})
    amp_graph.compile(model, policy, example_inputs=(idx, idx))  # the model's own path: fine
    graph = TrainGraph(model, policy)
    with pytest.raises(ValueError, match=r"matches no module of the graph.*'model\.lm_head'") as e:
        graph(idx, idx)
    assert "start at the Graph" in str(e.value)
    # The path of the Graph holds, and pins the head there.
    pinned = TrainGraph(
        model, amp_graph.Policy.preset("O1").override(modules={"model.lm_head": "fp32"})
    )
    pinned(idx, idx)
    head = [
        n.meta[AMP]
        for n in pinned.build_graph.graph.nodes
        if n.meta[AMP].module_path == "model.lm_head"
    ]
    assert {a.compute_dtype for a in head if a.aten == "linear"} == {FP32}


def test_a_misspelled_path_or_node_fails_the_same_way_everywhere() -> None:
    model, idx = _nanogpt()
    typo = amp_graph.Policy.preset("O1").override(modules={"transformer.h.0.atn": "fp32"})
    with pytest.raises(
        ValueError, match=r"matches no module of the model.*transformer\.h\.0\.attn"
    ):
        amp_graph.compile(model, typo)
    graph_typo = amp_graph.Policy.preset("O1").override(
        modules={"model.transformer.h.0.atn": "fp32"}
    )
    with pytest.raises(
        ValueError, match=r"matches no module of the graph.*model\.transformer\.h\.0\.attn"
    ):
        TrainGraph(model, graph_typo)(idx, idx)
    node_typo = amp_graph.Policy.preset("O1").override(nodes={"no_such_node": "fp32"})
    with pytest.raises(ValueError, match="names no node of the captured graph"):
        amp_graph.compile(model, node_typo, example_inputs=(idx, idx))
    with pytest.raises(ValueError, match="names no node of the captured graph"):
        TrainGraph(model, node_typo)(idx, idx)


@pytest.mark.parametrize(
    ("policy", "dtype", "error", "match"),
    [
        ("O5", None, ValueError, "unknown policy preset 'O5'.*O1"),
        ("O1", torch.float32, ValueError, "policy='O0'"),
        ("O1", "bf16", ValueError, "torch.bfloat16"),
        ("fp8", torch.float16, ValueError, "bfloat16, not float16"),
        (3, None, TypeError, "preset name"),
    ],
)
def test_a_bad_request_fails_where_it_is_made_with_one_message(policy, dtype, error, match) -> None:
    messages = set()
    with pytest.raises(error, match=match) as e:
        amp_graph.compile(nn.Linear(2, 2), policy, dtype)
    messages.add(str(e.value))
    with pytest.raises(error, match=match) as e:
        amp_graph.backend(policy, dtype)
    messages.add(str(e.value))
    with pytest.raises(error, match=match) as e:
        amp_graph.GraphConfig().enable_amp(True, policy=policy, dtype=dtype)
    messages.add(str(e.value))
    assert len(messages) == 1


def test_one_device_rule() -> None:
    model = nn.Linear(2, 2)
    assert device_type_of(model) == "cpu"
    model.register_buffer("step", torch.zeros(()))  # a CPU buffer before other devices
    model.to_empty(device="meta").register_buffer("host_counter", torch.zeros(()))
    assert device_type_of(model) == "meta"  # the first non-CPU device wins
    assert device_type_of(None, (torch.zeros(1), torch.empty(1, device="meta"))) == "meta"


def _o2_like(**changes) -> amp_graph.Policy:
    return dataclasses.replace(amp_graph.Policy.preset("O2"), **changes)


@pytest.mark.parametrize(
    ("policy", "masters"),
    [
        ("O2", True),
        (_o2_like(name="my-half-model"), True),  # O2 semantics under another name
        (_o2_like(master_weights=False), False),  # named O2, but asks for no masters
        ("O3", False),
    ],
    ids=["O2", "renamed-O2", "O2-without-masters", "O3"],
)
def test_master_weights_come_from_the_policy_field(policy, masters: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))

    class Train(amp_graph.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
            self.config.enable_amp(True, policy=policy, dtype=BF16)

        def build(self, x, y):
            loss = F.cross_entropy(self.model(x).float(), y)
            loss.backward()
            return loss

    Train()(x, y)
    stored = model[0].weight.dtype
    assert stored == (BF16 if masters else FP32)
    assert model[1].weight.dtype == FP32  # normalization stays float32 either way


def test_master_weights_need_o2_storage() -> None:
    with pytest.raises(ValueError, match="cast_inputs=True"):
        amp_graph.Policy("mine", default=amp_graph.Rule.ALLOW, master_weights=True)
