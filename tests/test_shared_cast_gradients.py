"""A cast several consumers share: under ``Policy(cast_gradients_per_consumer=True)`` (the
``"autocast"`` preset) their gradients sum in the source's dtype, as under torch.autocast
(one cast per consumer): each consumer gets a cast of its own where the copy is small
enough for its bytes to cost less than a read's Python (as autocast holds), else a read of
the shared copy (nothing more held for backward). The other presets sum them at the shared
copy."""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from amp_graph.passes.meta import is_dtype_cast

import amp_graph
from amp_graph.frontends import front_door
from amp_graph.frontends.compiler import compile_record
from amp_graph.frontends.front_door import COMPILE_META
from amp_graph.ops.cast_reads import cast_read
from amp_graph.ops.recompute_cost import RecomputeCost
from tests.hf_configs import small_llama_config
from tests.test_cuda_graph_step import RerunCapture

BF16 = torch.bfloat16


def _made(compiled) -> tuple[int, int]:
    """(reads, own casts) the pass made, from the compile's record and the graph."""
    stats = compile_record(compiled).stats
    reads = sum(n.target is cast_read for n in compiled.graph.nodes)
    assert stats.get("shared_cast_reads", 0) == reads
    return reads, stats.get("shared_cast_own_casts", 0)


class SharedInput(nn.Module):
    """Llama's shape in small: one RMSNorm output read by the Q, K and V projections, one by
    the SwiGLU's gate and up projections."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.norm_weight = nn.Parameter(torch.ones(dim))
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.gate, self.up = (nn.Linear(dim, 2 * dim, bias=False) for _ in range(2))
        self.down = nn.Linear(2 * dim, dim, bias=False)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.norm(x)
        q, k, v = (p(h).view(b, t, 4, d // 4).transpose(1, 2) for p in (self.q, self.k, self.v))
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(
            b, t, d
        )
        h = self.norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TitanBlock(nn.Module):
    """torchtitan's Llama block, trimmed: RMSNorm in float32, RoPE through complex numbers
    (``view_as_complex`` of a float32 copy, ``type_as`` back), SDPA, SwiGLU."""

    def __init__(self, dim: int = 32, heads: int = 4, seq: int = 16) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.w1, self.w3 = (nn.Linear(dim, 2 * dim, bias=False) for _ in range(2))
        self.w2 = nn.Linear(2 * dim, dim, bias=False)
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        freqs = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        angles = torch.outer(torch.arange(seq).float(), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles))

    def rope(self, x: torch.Tensor) -> torch.Tensor:
        x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        freqs = self.freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, x_.shape[-1])
        return torch.view_as_real(x_ * freqs).flatten(3).type_as(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.attention_norm(x)
        q, k, v = (w(h).view(b, t, self.heads, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = self.rope(q), self.rope(k)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.wo(out.transpose(1, 2).reshape(b, t, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _autocast_step(model: nn.Module, inputs: tuple, loss) -> dict[str, torch.Tensor]:
    with torch.autocast("cpu", BF16):
        out = model(*inputs)
    loss(out).backward()
    return _grads(model)


def _llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = small_llama_config()
    # eager attention: with SDPA, HF skips the causal mask only where it can look at the
    # mask's values, which a capture cannot, and the kernels then differ from the eager run's
    config._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 100, (2, 16))
    return model, (ids,), lambda out: out.logits.float().logsumexp(-1).mean()


def _shared_input():
    torch.manual_seed(0)
    weights = torch.randn(2, 16, 32)
    return SharedInput(), (torch.randn(2, 16, 32),), lambda out: (out.float() * weights).sum()


def _policy(name: str, per_consumer: bool, **fields) -> amp_graph.Policy:
    preset = amp_graph.Policy.preset(name)
    return dataclasses.replace(preset, cast_gradients_per_consumer=per_consumer, **fields)


def _titan():
    torch.manual_seed(0)
    weights = torch.randn(2, 16, 32)
    return TitanBlock(), (torch.randn(2, 16, 32),), lambda out: (out.float() * weights).sum()


@pytest.mark.parametrize(
    "build", [_shared_input, _llama, _titan], ids=["shared_input", "hf_llama", "torchtitan"]
)
def test_gradients_are_autocasts_bit_for_bit(build, shared_cast_way) -> None:
    model, inputs, loss = build()
    expected = _autocast_step(copy.deepcopy(model), inputs, loss)

    ours = copy.deepcopy(model)
    compiled = amp_graph.compile(ours, "autocast", BF16)  # the preset turns it on
    loss(compiled(*inputs)).backward()
    reads, own_casts = _made(compiled)
    layers = 2 if build is _llama else 1
    if shared_cast_way == "reads":  # q, k, v; gate, up (per layer)
        assert reads >= 5 * layers and own_casts == 0
    else:  # k, v; up: the first consumer keeps the shared cast
        assert reads == 0 and own_casts >= 3 * layers
    for name, grad in _grads(ours).items():
        assert torch.equal(grad, expected[name]), name

    # the same policy with it off: the consumers' gradients sum in bf16 at the shared copy,
    # and the gradients differ from autocast's
    shared = copy.deepcopy(model)
    off = amp_graph.compile(shared, _policy("autocast", False), BF16)
    loss(off(*inputs)).backward()
    assert _made(off) == (0, 0)
    assert any(not torch.equal(g, expected[n]) for n, g in _grads(shared).items())


def test_only_the_autocast_preset_turns_it_on() -> None:
    model, inputs, _ = _shared_input()
    for name in ("O1", "O2", "O3", "fp8", "autocast"):
        assert amp_graph.Policy.preset(name).cast_gradients_per_consumer is (name == "autocast")
    o1 = amp_graph.compile(model, "O1", BF16, example_inputs=inputs)
    assert _made(o1) == (0, 0)
    on = amp_graph.compile(model, _policy("O1", True), BF16, example_inputs=inputs)
    # the suite's pinned CPU cost: 2 KiB copies, far below a read's time: k, v; up
    assert _made(on) == (0, 3)
    with pytest.raises(ValueError, match="cast_gradients_per_consumer is True or False"):
        _policy("O1", "yes")


def test_a_copy_casts_per_consumer_up_to_what_a_read_costs(monkeypatch) -> None:
    """The decision's edge: each of the model's shared copies is 2 KiB (2x16x32 in bf16);
    a read that takes as long as writing 2 KiB gives their consumers casts of their own,
    one that takes a byte's time less, reads."""
    model, inputs, _ = _shared_input()
    made = {}
    for per_read_ns in (2048.0, 2047.0):
        cost = RecomputeCost(7e3, 2e3, copy_bytes_per_ns=1.0, per_read_ns=per_read_ns)
        monkeypatch.setattr(front_door, "measured_cost", lambda device, c=cost: c)
        compiled = amp_graph.compile(model, "autocast", BF16, example_inputs=inputs)
        made[per_read_ns] = _made(compiled)
    assert made == {2048.0: (0, 3), 2047.0: (5, 0)}


def test_without_a_measured_cost_every_consumer_reads(monkeypatch) -> None:
    """On a device the cost cannot be timed on, or where AOTAutograd compiles the graph
    (its own kernels then sum in float32), the consumers read: nothing more is held."""
    model, inputs, _ = _shared_input()
    monkeypatch.setattr(front_door, "TIMED_DEVICE_TYPES", ())
    compiled = amp_graph.compile(model, "autocast", BF16, example_inputs=inputs)
    assert _made(compiled) == (5, 0)


def test_the_backend_without_inductor_is_autocasts_bit_for_bit() -> None:
    model, inputs, loss = _shared_input()
    expected = _autocast_step(copy.deepcopy(model), inputs, loss)
    for inner in ("eager", "aot_eager"):
        ours = copy.deepcopy(model)
        compiled = torch.compile(ours, backend=amp_graph.backend("autocast", BF16, inner=inner))
        loss(compiled(*inputs)).backward()
        for name, grad in _grads(ours).items():
            assert torch.equal(grad, expected[name]), (inner, name)


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd keeps for backward during ``fn()``."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def test_backward_holds_one_copy_where_consumers_read_and_autocasts_where_they_cast(
    shared_cast_way,
) -> None:
    """Each consumer reads the one copy (a view of it: nothing more kept for backward), or
    casts its own (one copy each, as torch.autocast keeps); a parameter's casts stay
    shared, as autocast caches them."""
    model, inputs, _ = _shared_input()
    policy = _policy("autocast", True, recompute_casts=False)
    compiled = amp_graph.compile(model, policy, BF16, example_inputs=inputs)
    reads = [n for n in compiled.graph.nodes if n.target is cast_read]
    held = _saved_bytes(lambda: compiled(*inputs))

    plain = amp_graph.compile(
        model, _policy("autocast", False, recompute_casts=False), BF16, example_inputs=inputs
    )
    assert _made(plain) == (0, 0)
    one_copy = _saved_bytes(lambda: plain(*inputs))
    if shared_cast_way == "reads":
        assert len(reads) == 5  # q, k and v read the first norm's output; gate and up the second
        for read in reads:
            source, cast = read.args
            assert cast.args[0] is source and source.meta["amp"].role.value != "param"
        assert held == one_copy
    else:
        assert not reads
        with torch.autocast("cpu", BF16):
            autocasts = _saved_bytes(lambda: model(*inputs))
        assert held == autocasts > one_copy  # three more 2 KiB copies: k's, v's, up's
        assert held - one_copy == 3 * 2 * 16 * 32 * 2


class SharedInputStep(amp_graph.Graph):
    """The "autocast" preset's training step, replayed through a stand-in for the CUDA
    capture (the CPU has none) where asked."""

    _step_capture = RerunCapture

    def __init__(self, model: nn.Module, replayed: bool) -> None:
        super().__init__()
        self.model = model
        lr = torch.tensor(0.1)
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=lr, fused=True))
        self.config.enable_amp(True, policy="autocast", dtype=BF16)
        if replayed:
            self.config.enable_cuda_graph(True, warmup_steps=1)

    def build(self, x: torch.Tensor) -> torch.Tensor:
        loss = self.model(x).float().sum()
        loss.backward()
        return loss


@pytest.mark.parametrize("replayed", [False, True], ids=["eager", "cuda graphs"])
def test_a_step_replayed_as_cuda_graphs_reads_its_shared_casts(replayed: bool) -> None:
    """A replayed CUDA graph pays a read's host time once, at its capture: a cast per
    consumer would only add kernels and held bytes there, so every consumer reads."""
    model, inputs, _ = _shared_input()
    step = SharedInputStep(model, replayed)
    for _ in range(3):
        step(*inputs)
    stats = step.build_graph.meta[COMPILE_META].stats
    made = (stats["shared_cast_reads"], stats["shared_cast_own_casts"])
    assert made == ((5, 0) if replayed else (0, 3))


class ThreeReadsOfTheInput(nn.Module):
    """The graph's input itself read by three projections: its one cast is shared."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(x) * self.k(x) + self.v(x)


def test_an_input_autocast_caches_keeps_one_shared_cast() -> None:
    """A float32 leaf that requires grad, given to the graph, is cast once by torch.autocast
    (its cache's rule, as for a weight), so its consumers' gradients sum in bf16 there: the
    pass reads it (the read decides when it runs) and never gives its consumers casts of
    their own, small as the copy is, which would sum in float32."""
    torch.manual_seed(0)
    model, weights = ThreeReadsOfTheInput(), torch.randn(4, 16, 32)
    x = torch.randn(4, 16, 32, requires_grad=True)
    with torch.autocast("cpu", BF16):
        (model(x).float() * weights).sum().backward()
    expected = x.grad
    x.grad = None

    compiled = amp_graph.compile(model, "autocast", BF16, example_inputs=(x,))
    assert _made(compiled) == (3, 0)  # the pinned cost would cast 4 KiB copies per consumer
    (compiled(x).float() * weights).sum().backward()
    assert torch.equal(x.grad, expected)


def test_a_read_is_the_cast_where_autocast_shares_one_or_nothing_needs_a_gradient() -> None:
    leaf = torch.randn(4, 8, requires_grad=True)
    source = leaf * 1.0  # an activation
    cast = source.to(BF16)
    with torch.no_grad():
        assert cast_read(source, cast) is cast
    assert cast_read(source.detach(), cast) is cast
    # a float32 leaf that requires grad: autocast caches its cast, as a weight's
    leaf_cast = leaf.to(BF16)
    assert cast_read(leaf, leaf_cast) is leaf_cast
    read = cast_read(source, cast)
    assert read is not cast and read.data_ptr() == cast.data_ptr() and torch.equal(read, cast)
    read.float().sum().backward()
    assert leaf.grad.dtype == torch.float32 and torch.equal(leaf.grad, torch.ones(4, 8))


class CheckpointedShared(SharedInput):
    """The attention half under ``torch.utils.checkpoint``: its casts live in the block's
    submodule, which backward runs again."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def attention(x: torch.Tensor) -> torch.Tensor:
            b, t, d = x.shape
            h = self.norm(x)
            q, k, v = (p(h).view(b, t, 4, d // 4).transpose(1, 2) for p in (self.q, self.k, self.v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return x + out.transpose(1, 2).reshape(b, t, d)

        x = torch.utils.checkpoint.checkpoint(attention, x, use_reentrant=False)
        h = self.norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def test_checkpointed_blocks_take_their_shared_casts_per_consumer_too(shared_cast_way) -> None:
    torch.manual_seed(0)
    model, weights = CheckpointedShared(), torch.randn(2, 16, 32)
    x = torch.randn(2, 16, 32)
    expected = _autocast_step(copy.deepcopy(model), (x,), lambda out: (out * weights).sum())
    ours = copy.deepcopy(model)
    compiled = amp_graph.compile(ours, "autocast", BF16)
    (compiled(x) * weights).sum().backward()
    block = compiled.graph_module.get_submodule("checkpoint_0")
    block_reads = sum(n.target is cast_read for n in block.graph.nodes)
    casts_per_source = Counter(n.args[0] for n in block.graph.nodes if is_dtype_cast(n))
    if shared_cast_way == "reads":  # q, k, v read one cast
        assert block_reads == 3 and max(casts_per_source.values()) == 1
    else:  # q, k, v cast their own
        assert block_reads == 0 and max(casts_per_source.values()) == 3
    for name, grad in _grads(ours).items():
        assert torch.equal(grad, expected[name]), name


def test_inspection_looks_through_the_reads(monkeypatch) -> None:
    """The diff, the drawing and ``explain`` show the plan: each consumer reads the cast."""
    monkeypatch.setattr(front_door, "measured_cost", lambda device: RecomputeCost(7e3, 2e3, 10.0))
    model, inputs, _ = _shared_input()
    compiled = amp_graph.compile(model, "autocast", BF16, example_inputs=inputs)
    reads = [n for n in compiled.graph.nodes if n.target is cast_read]
    assert reads
    diff = amp_graph.inspect.diff(compiled)
    assert not any(row.node.startswith("cast_read") for row in diff.rows)
    assert diff.count("added") == amp_graph.report(compiled).casts_kept
    consumer = next(iter(reads[0].users))
    cast = reads[0].args[1]
    assert f"'{cast.name}'" in str(amp_graph.explain(compiled, consumer.name))
