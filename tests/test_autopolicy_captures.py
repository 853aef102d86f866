"""autopolicy judges each set of demotions on the graph ``compile`` captures under it, and
against the float32 model itself: a model whose Python builds constants from a low dtype
(HF's ``torch.finfo(dtype).min`` causal mask) is fixed by demoting the value it read, and
what autopolicy returns meets ``tol`` when compiled afresh."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from amp_graph.passes.meta import DTYPE_READ

import amp_graph
from amp_graph.accuracy.autopolicy_search import _forward_finding, _Search
from amp_graph.accuracy.float32_error import output_error
from amp_graph.accuracy.shadow import Measure, NumericsRow, ShadowResult
from amp_graph.policy import Policy

FP16 = torch.float16
TOL = 10 * torch.finfo(FP16).eps  # autopolicy's default for float16


class MaskedDecoder(nn.Module):
    """One attention layer written as HF writes it: an additive causal mask filled with
    ``torch.finfo(embeddings.dtype).min``, and attention scores (up to ~8e5) far beyond
    float16's range."""

    def __init__(self, vocab: int = 64, dim: int = 32, dropout: float = 0.0) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(dim, vocab)
        with torch.no_grad():
            self.qkv.weight.mul_(300.0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        t = ids.shape[1]
        mask = torch.full((t, t), torch.finfo(h.dtype).min, dtype=h.dtype).triu(1)
        q, k, v = self.qkv(h).split(h.shape[-1], dim=-1)
        scores = q @ k.transpose(-1, -2) + mask
        return self.drop(self.out(scores.softmax(-1) @ v))


def _samples(n: int = 3) -> list[tuple[torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 64, (2, 16), generator=generator),) for _ in range(n)]


def _model(**kwargs) -> MaskedDecoder:
    torch.manual_seed(0)
    return MaskedDecoder(**kwargs).eval()


@pytest.mark.parametrize(("policy", "marked"), [("O2", True), ("O1", False)])
def test_the_capture_marks_the_low_values_whose_dtype_the_python_read(policy, marked):
    """Under O2 the embedding is float16 when the mask reads its dtype; under O1 it is
    float32, and a float32 read marks nothing."""
    model = _model()
    compiled = amp_graph.compile(model, policy=policy, dtype=FP16)
    with torch.no_grad():
        compiled(*_samples(1)[0])
    read = {n.name for n in compiled.graph_module.graph.nodes if n.meta.get(DTYPE_READ)}
    assert ("embedding" in read) is marked
    assert all(
        n.meta["val"].dtype == FP16
        for n in compiled.graph_module.graph.nodes
        if n.meta.get(DTYPE_READ) and n.op != "get_attr"
    )


@pytest.mark.parametrize("policy", ["O2", "O3"])
def test_autopolicy_fixes_a_mask_built_from_a_low_dtype(policy):
    """Demoting the overflowing matmul is not enough: the graph still holds the mask value
    -65504 (float16's min), which no longer masks float32 scores of -8e5. The graph's own
    float32 shadow holds it too, so only the float32 model shows it; the embedding whose
    dtype the mask read is demoted, and the policy, compiled afresh, meets tol."""
    model = _model()
    samples = _samples()
    policy_found = amp_graph.autopolicy(model, policy, FP16, sample_inputs=samples)
    assert "embedding" in policy_found.nodes
    assert "read the low dtype of embedding" in policy_found.notes["embedding"]
    compiled = amp_graph.compile(model, policy=policy_found, dtype=FP16)
    plain = amp_graph.compile(model, policy=policy, dtype=FP16)
    with torch.no_grad():
        for (ids,) in samples:
            assert output_error(compiled(ids), model(ids)).rel_l2 <= TOL
        assert output_error(plain(samples[0][0]), model(samples[0][0])).rel_l2 > TOL


def test_without_the_embedding_the_policy_misses_tol_against_the_float32_model():
    """The demotion of the embedding is needed (not a give-back leftover): without it the
    policy's graph is far from the float32 model."""
    model = _model()
    found = amp_graph.autopolicy(model, "O2", FP16, sample_inputs=_samples())
    nodes = {n: r for n, r in found.nodes.items() if n != "embedding"}
    without = amp_graph.Policy.preset("O2").override(nodes=nodes)
    compiled = amp_graph.compile(model, policy=without, dtype=FP16)
    (ids,) = _samples(1)[0]
    with torch.no_grad():
        assert output_error(compiled(ids), model(ids)).rel_l2 > TOL


def test_a_nondeterministic_forward_is_judged_against_its_shadow_only():
    """Dropout in training mode: two float32 runs differ, so the float32 model is no
    reference; the shadow (which draws the same numbers as the mixed run) still is, and a
    model that needs nothing keeps its policy."""
    torch.manual_seed(0)
    model = MaskedDecoder(dropout=0.5).train()
    with torch.no_grad():
        model.qkv.weight.div_(300.0)  # nothing overflows
    samples = _samples(2)
    with torch.no_grad():  # the premise: two float32 runs are further apart than tol
        assert output_error(model(*samples[1]), model(*samples[1])).rel_l2 > TOL
    search = _Search(
        model, Policy.preset("O1"), FP16, "cpu", [(s, {}) for s in samples], TOL,
        False, None, None, "auto",
    )  # fmt: skip
    assert search.references() == [None, None]
    model.eval()
    search = _Search(
        model, Policy.preset("O1"), FP16, "cpu", [(s, {}) for s in samples], TOL,
        False, None, None, "auto",
    )  # fmt: skip
    with torch.no_grad():
        assert all(
            torch.equal(ref, model(*s)) for ref, s in zip(search.references(), samples, strict=True)
        )
    model.train()
    policy = amp_graph.autopolicy(model, "O1", FP16, sample_inputs=samples)
    assert dict(policy.nodes) == {}
    assert model.training  # left as it was


class NormedMaskedLogits(nn.Module):
    """Batch norm (in training mode it updates its running statistics) and logits with
    -inf where masked, as a float32 model legitimately returns them."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.norm(self.lin(x))
        return logits.masked_fill(torch.arange(8) >= 6, float("-inf"))


def test_the_float32_reference_keeps_the_models_buffers_and_skips_nonfinite_outputs():
    """The reference runs leave batch norm's running statistics as they were; an output
    with -inf where the model masks is no reference for a relative error, so a model that
    needs nothing keeps its policy instead of failing on inf - inf."""
    torch.manual_seed(0)
    model = NormedMaskedLogits().train()
    samples = [(torch.randn(4, 8),) for _ in range(2)]
    stats = [b.clone() for b in model.buffers()]
    search = _Search(
        model, Policy.preset("O1"), FP16, "cpu", [(s, {}) for s in samples], TOL,
        False, None, None, "auto",
    )  # fmt: skip
    assert search.references() == [None, None]
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), stats, strict=True))
    policy = amp_graph.autopolicy(model, "O1", FP16, sample_inputs=samples)
    assert dict(policy.nodes) == {}
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), stats, strict=True))


def _row(node, dtype, error, inputs=(), users=()):
    return NumericsRow(
        index=0,
        node=node,
        module="",
        op=node,
        role="op",
        forward=Measure(dtype=dtype, rel_error=error),
        inputs=inputs,
        users=users,
    )


def test_a_float32_op_amplifying_low_rounding_blames_the_low_ops_feeding_it():
    """The largest error growth is at a float32 softmax (scores too large for float16's
    precision): the low matmul feeding it is blamed, not the low op elsewhere whose own
    rounding grows more than the matmul's."""
    rows = [
        _row("elsewhere", FP16, 0.02),
        _row("matmul", FP16, 0.001, users=("softmax",)),
        _row("softmax", torch.float32, 0.5, inputs=("matmul",)),
    ]
    result = ShadowResult(rows, [], [Measure(None, rel_error=0.5)], FP16, None, None)
    finding = _forward_finding(result, 0, TOL)
    assert finding is not None and finding.nodes == ("matmul",)
    assert "'softmax' (softmax, float32) amplifies the rounding" in finding.reason
