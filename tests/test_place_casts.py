"""The cast placement (passes/place_casts.py) on models as people write them: under O2 the
free ops (low by the default rule alone) are labelled by an exact minimum cut of the cast
bytes. It only raises ops to float32, the graph's casts cost what the cut says, which is
never more than the rules' plan, and gradients stay within bf16's rounding of today's."""

from __future__ import annotations

import copy
import dataclasses
import itertools
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from amp_graph.passes.assign_dtypes import assign_dtypes
from amp_graph.passes.cast_cut import cost_of, solve
from amp_graph.passes.cast_outputs import cast_outputs
from amp_graph.passes.classify import classify
from amp_graph.passes.graph_copy import copy_graph_module
from amp_graph.passes.insert_casts import insert_casts
from amp_graph.passes.meta import AMP, Role, has_cast_role
from amp_graph.passes.place_casts import cast_problem, converted_bytes, place_casts
from amp_graph.passes.simplify_casts import simplify_casts
from model_zoo import build

import amp_graph
from amp_graph.frontends.compiler import compile_record
from amp_graph.inspect.held import held_for_backward

BF16 = torch.bfloat16
LOW_AND_FP32 = (BF16, torch.float32)
MODELS = ["gpt2", "bert", "clip", "deberta_v2", "opt", "t5_encoder"]


def o2(place: bool = True) -> amp_graph.Policy:
    return dataclasses.replace(amp_graph.Policy.preset("O2"), place_casts=place)


def compiled(name: str, policy: amp_graph.Policy):
    model, kwargs = build(name)
    model.eval()  # dropout off: the two plans see the same random numbers (none)
    c = amp_graph.compile(model, policy=policy, dtype=BF16)
    c(**kwargs)
    return model, kwargs, c


def planned(
    name: str, place: bool, output_dtype: torch.dtype | None = None
) -> tuple[torch.fx.GraphModule, dict[str, int]]:
    """The captured graph of ``name`` planned under O2 and cast (classify, assign_dtypes,
    place_casts where asked, insert_casts, cast_outputs under ``output_dtype``,
    simplify_casts), with place_casts' counters."""
    _, _, c = compiled(name, o2(False))
    return replanned(c, place, output_dtype)


def replanned(
    c, place: bool, output_dtype: torch.dtype | None, cut_reads_outputs: bool = True
) -> tuple[torch.fx.GraphModule, dict[str, int]]:
    """The captured graph of ``c`` planned again under O2, as the pipeline plans it
    (``cut_reads_outputs=False``: the cut not told that ``cast_outputs`` returns the outputs
    in ``output_dtype``, as it was before it knew)."""
    record = compile_record(c.graph_module)
    gm = copy_graph_module(record.original)
    classify(gm, record.policy)
    assign_dtypes(gm, BF16, record.policy.cast_inputs)
    stats = {}
    if place:
        told = output_dtype if cut_reads_outputs else None
        stats = place_casts(gm, BF16, record.policy.cast_inputs, (), told).stats
    insert_casts(gm)
    if output_dtype is not None:
        stats["outputs_cast"] = cast_outputs(gm, output_dtype).stats["outputs_cast"]
    simplify_casts(gm)
    return gm, stats


def cast_bytes(gm: torch.fx.GraphModule) -> int:
    """The bytes the graph's conversions between bf16 and float32 move per call, counted on
    its cast nodes (not on the cut's problem)."""
    return converted_bytes(gm, BF16)


@pytest.mark.parametrize("name", MODELS)
def test_the_graphs_casts_cost_what_the_cut_says(name):
    before, _ = planned(name, place=False)
    after, stats = planned(name, place=True)
    assert cast_bytes(before) == stats["placed_cast_bytes_before"]
    assert cast_bytes(after) == stats["placed_cast_bytes_after"]
    assert stats["placed_cast_bytes_after"] <= stats["placed_cast_bytes_before"]


@pytest.mark.parametrize("name", MODELS)
def test_the_casts_returning_outputs_in_float32_are_among_the_cuts(name):
    """O2 returns its low outputs in float32 (``output_dtype``, passes/cast_outputs.py): the
    cut reads each output in float32, so the cast that returns one is costed (shared with
    an op's float32 cast of the same value) and the graph's casts, those casts included,
    still cost what the cut says."""
    before, _ = planned(name, place=False, output_dtype=torch.float32)
    after, stats = planned(name, place=True, output_dtype=torch.float32)
    assert stats["outputs_cast"] > 0
    assert cast_bytes(before) == stats["placed_cast_bytes_before"]
    assert cast_bytes(after) == stats["placed_cast_bytes_after"]
    assert stats["placed_cast_bytes_after"] <= stats["placed_cast_bytes_before"]


@pytest.mark.parametrize("name", ["bert", "clip", "deberta_v2"])
def test_o2_casts_fewer_bytes_on_encoders(name):
    _, stats = planned(name, place=True)
    assert stats["ops_moved_up"] > 0
    assert stats["placed_cast_bytes_after"] <= 0.93 * stats["placed_cast_bytes_before"]


@pytest.mark.parametrize("name", MODELS)
def test_no_op_moves_down_and_outputs_keep_their_dtypes(name):
    before, _ = planned(name, place=False)
    after, stats = planned(name, place=True)
    was = {n.name: n.meta[AMP] for n in before.graph.nodes}
    raised = []
    for node in after.graph.nodes:
        amp = node.meta[AMP]
        if node.name not in was or amp.role is Role.CAST:
            continue
        old = was[node.name]
        if amp.compute_dtype != old.compute_dtype:
            assert (old.compute_dtype, amp.compute_dtype) == (BF16, torch.float32), node.name
            assert amp.source == "placement" and old.source == "default", node.name
            raised.append(node.name)
    assert len(raised) == stats.get("ops_moved_up", 0)
    outputs = [n for n in after.graph.nodes if n.op == "output"]
    assert outputs[0].meta[AMP].out_dtype == was["output"].out_dtype


def _bert_config(**extra: Any) -> Any:
    """A random small ``BertConfig`` (2 layers of width 64, a vocabulary of 100), with
    ``extra`` fields."""
    transformers = pytest.importorskip("transformers")
    return transformers.BertConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
        vocab_size=100,
        **extra,
    )


def _encoder(name: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "bert":
        return transformers.BertModel(_bert_config()).eval()
    config = transformers.GPT2Config(
        n_positions=64, n_embd=64, n_layer=2, n_head=2, vocab_size=100, use_cache=False
    )
    return transformers.GPT2Model(config).eval()


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_gradients_stay_within_bf16s_rounding_of_the_rules_plan(name):
    """All gradients together, placed, are as close to float32's as the rules' plan's are,
    and within bf16's rounding of them (8x32 tokens: on a handful of numbers the rounding of
    either plan is noise)."""
    tokens = torch.randint(0, 100, (8, 32), generator=torch.Generator().manual_seed(0))
    grads = {}
    for plan, policy in (
        ("rules", o2(False)),
        ("placed", o2(True)),
        ("float32", amp_graph.Policy.preset("O0")),
    ):
        model = _encoder(name)
        c = amp_graph.compile(model, policy=policy, dtype=BF16)
        c(input_ids=tokens).last_hidden_state.float().square().mean().backward()
        grads[plan] = torch.cat(
            [p.grad.flatten() for p in model.parameters() if p.grad is not None]
        )
    reference = grads["float32"].norm()
    rules = (grads["rules"] - grads["float32"]).norm() / reference
    placed = (grads["placed"] - grads["float32"]).norm() / reference
    assert placed <= max(1.25 * rules, 2**-9)
    assert (grads["placed"] - grads["rules"]).norm() / reference <= 2**-7


class TinyLM(nn.Module):
    """Pre-norm residual blocks over token and position embeddings, as nanoGPT writes
    them: the stream starts from two float32 tables and runs through adds between low
    matmuls and float32 norms."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(64, 16), nn.Embedding(32, 16)
        self.norm = nn.LayerNorm(16)
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.final = nn.LayerNorm(16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for _ in range(2):
            x = x + self.down(torch.relu(self.up(self.norm(x))))
        return self.final(x)


TOKENS = torch.randint(0, 64, (2, 8))


def _small_problem():
    model = TinyLM()
    c = amp_graph.compile(model, policy=o2(False), dtype=BF16)
    c(TOKENS)
    record = compile_record(c.graph_module)
    gm = copy_graph_module(record.original)
    classify(gm, record.policy)
    assign_dtypes(gm, BF16, record.policy.cast_inputs)
    return gm, record


def test_on_a_real_graph_the_cut_is_the_brute_force_optimum():
    gm, _ = _small_problem()
    problem, free = cast_problem(gm, BF16)
    assert 2 <= len(free) <= 16
    best = min(
        (cost_of(problem, [n for n, up in zip(problem.free, bits, strict=True) if up]), sum(bits))
        for bits in itertools.product((False, True), repeat=len(problem.free))
        if _keeps_ties(problem, bits)
    )
    placement = solve(problem)
    assert (placement.cost, len(placement.raised)) == best
    assert placement.cost < placement.cost_before  # the tables' gathers go up: casts saved


def _keeps_ties(problem, bits) -> bool:
    try:
        cost_of(problem, [n for n, up in zip(problem.free, bits, strict=True) if up])
    except ValueError:
        return False
    return True


def test_the_tables_are_gathered_then_cast_and_explain_says_so():
    """TinyLM's float32 tables: the rules cast each whole to bf16 for its gather; placed,
    the gathers read them in float32 and only the rows gathered are cast. The adds stay low:
    the norms save them for backward, which would then hold them in float32."""
    c = amp_graph.compile(TinyLM(), policy=o2(), dtype=BF16)
    c(TOKENS)
    nodes = {n.name: n for n in c.graph_module.graph.nodes}
    gathers = [nodes["embedding"], nodes["embedding_1"]]
    for gather in gathers:
        assert gather.meta[AMP].source == "placement"
        assert gather.meta[AMP].compute_dtype == torch.float32
        table = gather.args[0]
        assert not has_cast_role(table) and table.op == "get_attr"
    adds = [n for name, n in nodes.items() if name.startswith("add") and not has_cast_role(n)]
    assert adds and all(n.meta[AMP].compute_dtype == BF16 for n in adds)
    text = amp_graph.explain(c, "embedding")
    assert "cast placement" in text and "bytes of casts per call" in text
    assert "nodes={'embedding': 'low'}" in text
    report = amp_graph.report(c)
    assert report.ops_moved_up == 2
    assert report.placed_cast_bytes_after < report.placed_cast_bytes_before
    assert report.placed_casts_after == report.placed_casts_before  # smaller ones: rows
    casts = f"casts {report.placed_casts_before} -> {report.placed_casts_after}"
    assert casts in report.totals()
    assert "cast placement (an exact minimum cut)" in report.totals()
    # an explicit rule is a constraint: the overridden gather stays low
    kept = amp_graph.compile(TinyLM(), policy=o2().override(nodes={"embedding": "low"}))
    kept(TOKENS)
    node = next(n for n in kept.graph_module.graph.nodes if n.name == "embedding")
    assert node.meta[AMP].compute_dtype == BF16


@pytest.mark.parametrize("name", ["gpt2", "bert", "clip", "opt"])
def test_backward_holds_no_more_than_under_the_rules(name):
    held = {}
    for place in (False, True):
        model, kwargs, c = compiled(name, o2(place))
        params = [*model.parameters(), *model.buffers()]
        held[place], _ = held_for_backward(lambda c=c, k=kwargs: c(**k), exclude=params)
    assert held[True] <= held[False]


def test_a_calibrated_island_has_no_low_op():
    """GPT-2 with one MLP overridden to float32: every op inside the island computes in
    float32 and reads its neighbours there without a cast."""
    policy = o2().override(modules={"transformer.h.0.mlp": "fp32"})
    _, _, c = compiled("gpt2", policy)
    inside = [
        n
        for n in c.graph_module.graph.nodes
        if n.meta[AMP].module_path.startswith("transformer.h.0.mlp") and not has_cast_role(n)
    ]
    assert inside
    ops = [n for n in inside if n.meta[AMP].compute_dtype is not None]
    assert ops and all(n.meta[AMP].compute_dtype == torch.float32 for n in ops)
    for node in inside:  # no cast between two of its ops
        casts = [a for a in node.all_input_nodes if has_cast_role(a)]
        assert not any(c.args[0] in inside for c in casts), node


def test_it_is_the_default_under_o2_an_option_under_o3_and_checked():
    """On under O2 (it only raises ops), off under O3 ("everything low") and with
    place_casts=False; O1 does not run it (no op is free)."""
    assert amp_graph.Policy.preset("O2").place_casts is True
    assert amp_graph.Policy.preset("O3").place_casts is False
    default = amp_graph.compile(TinyLM(), policy="O2", dtype=BF16)
    default(TOKENS)
    assert "place_casts" in compile_record(default.graph_module).seconds
    assert amp_graph.report(default).ops_moved_up == 2
    for policy in (o2(False), "O3", "O1"):
        rules = amp_graph.compile(TinyLM(), policy=policy, dtype=BF16)
        rules(TOKENS)
        assert "place_casts" not in compile_record(rules.graph_module).seconds
        assert "cast placement" not in amp_graph.report(rules).totals()
    o3 = dataclasses.replace(amp_graph.Policy.preset("O3"), place_casts=True)
    asked = amp_graph.compile(TinyLM(), policy=o3, dtype=BF16)
    asked(TOKENS)
    assert amp_graph.report(asked).ops_moved_up == 2
    with pytest.raises(ValueError, match="place_casts is True"):
        dataclasses.replace(amp_graph.Policy.preset("O2"), place_casts="yes")
    from amp_graph.policy.policy_data import policy_as_data, policy_from_data

    assert policy_from_data(policy_as_data(o2(True))).place_casts is True
    assert policy_from_data(policy_as_data(o2(False))).place_casts is False


def test_o1_has_nothing_to_place():
    """O1's default rule is FOLLOW: no free op, so the placement changes no dtype."""
    plans = {}
    for place in (False, True):
        policy = dataclasses.replace(amp_graph.Policy.preset("O1"), place_casts=place)
        c = amp_graph.compile(TinyLM(), policy=policy, dtype=BF16)
        c(TOKENS)
        plans[place] = [(n.name, n.meta[AMP].compute_dtype) for n in c.graph_module.graph.nodes]
    assert plans[True] == plans[False]


class _O2Step(amp_graph.Graph):
    """An O2 training step of ``model`` with SGD at ``lr``; subclasses write the build."""

    def __init__(self, model: nn.Module, lr: float = 0.1) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=lr))
        self.config.enable_amp(True, policy="O2", dtype=BF16)


class TrainTinyLM(_O2Step):
    def build(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.model(tokens)
        out.float().square().mean().backward()
        return out.detach()


def _raised(gm: torch.fx.GraphModule) -> set[str]:
    return {n.meta[AMP].module_path for n in gm.graph.nodes if n.meta[AMP].source == "placement"}


@pytest.mark.usefixtures("fresh_dynamo")
def test_every_entry_point_plans_the_same_and_stores_what_it_reads():
    """One storage model: ``compile``, the backend, an O2 ``Graph`` and an export raise the
    same gathers and compute the same outputs, bit for bit. compile reads the float32
    tables and casts the rows; the backend's dtypes are compile's; the Graph keeps the two
    tables in float32 (read only in float32: no low copy), the linears as bf16 copies; the
    export stores the tables in bf16 (the rows' cast moved before the gather: the same
    bits)."""
    from amp_graph.frontends.dynamo_backend import backend, captured_graphs

    torch.manual_seed(0)
    model = TinyLM()
    copies = [copy.deepcopy(model) for _ in range(3)]
    reference = amp_graph.compile(model, "O2", BF16)
    want = reference(TOKENS)
    assert _raised(reference.graph_module) == {"embed", "pos"}

    dynamo = torch.compile(copies[0], backend=backend("O2", BF16, inner="eager"))
    got = dynamo(TOKENS)
    [gm] = captured_graphs(dynamo)
    assert _raised(gm) == {"embed", "pos"}
    assert torch.equal(got, want)

    graph = TrainTinyLM(copies[1])
    assert torch.equal(graph(TOKENS), want)
    assert copies[1].embed.weight.dtype == torch.float32
    assert copies[1].pos.weight.dtype == torch.float32
    assert copies[1].up.weight.dtype == BF16

    program = amp_graph.export(copies[2].eval(), (TOKENS,), policy="O2", dtype=BF16)
    assert program.state_dict["embed.weight"].dtype == BF16
    assert program.state_dict["pos.weight"].dtype == BF16
    with torch.no_grad():
        assert torch.equal(program.module()(TOKENS), want)


def test_a_replan_never_takes_the_first_plans_value_for_its_own():
    """HF Mamba's ``-torch.exp(self.A_log.float())`` of its slow path: the capture computed
    the ``neg`` in float32, the rules plan it low, the cut raises it back. assign_dtypes
    wrote the rules' bf16 value over the capture's, so the re-plan, reaching the capture's
    decision again, must not take that value as the capture's (assign_dtypes drops the
    capture's record, meta CAPTURE_PLAN, where it writes a value of its own)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MambaConfig(
        hidden_size=32, num_hidden_layers=2, vocab_size=100, state_size=8, use_cache=False
    )
    model = transformers.MambaForCausalLM(config).eval()
    ids = torch.randint(0, 100, (2, 12))
    c = amp_graph.compile(model, o2(), BF16, check_each_pass=True)
    with torch.no_grad():
        placed = c(input_ids=ids).logits
    raised = [n for n in c.graph_module.graph.nodes if n.meta[AMP].source == "placement"]
    assert raised
    for node in raised:
        assert node.meta[AMP].compute_dtype == torch.float32
        assert node.meta["val"].dtype == node.meta[AMP].out_dtype == torch.float32
    with torch.no_grad():
        rules = amp_graph.compile(model, o2(False), BF16)(input_ids=ids).logits
    torch.testing.assert_close(placed, rules, rtol=2e-2, atol=2e-2)


def _bert_returning_attentions(dropout: float = 0.0) -> tuple[nn.Module, dict]:
    """HF BERT in training, returning its attention maps (``output_attentions=True``, eager
    attention). Dropout p=0 by default: its ops stay in the graph, and every value is
    deterministic."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = _bert_config(
        attention_probs_dropout_prob=dropout,
        hidden_dropout_prob=dropout,
        attn_implementation="eager",
    )
    tokens = torch.randint(0, 100, (4, 32), generator=torch.Generator().manual_seed(0))
    return transformers.BertModel(config).train(), {
        "input_ids": tokens,
        "output_attentions": True,
    }


def test_attention_maps_returned_in_float32_skip_the_round_trip_through_bf16():
    """The maps are float32 softmax values through a free dropout. O2 returns them in float32
    (output_dtype): the cut, counting that read, raises each dropout to float32 instead of
    casting the maps down for it and back up to return them. The maps are then softmax's
    float32 values, which round to what the low dropout returned, and nothing else moves:
    the hidden states and every gradient are the same bits as with the outputs as computed
    (``output_dtype=None``, where the cut keeps the dropouts low)."""
    runs = {}
    for output_dtype in (torch.float32, None):
        model, kwargs = _bert_returning_attentions()
        c = amp_graph.compile(model, "O2", BF16, output_dtype=output_dtype)
        out = c(**kwargs)
        (out.last_hidden_state.float().square().mean() + out.pooler_output.float().sum()).backward()
        grads = {name: p.grad for name, p in model.named_parameters()}
        runs[output_dtype] = (c, out, grads)
    placed, out, grads = runs[torch.float32]
    _, as_computed, as_computed_grads = runs[None]

    returned = placed.graph_module.graph.output_node().all_input_nodes
    raised = [n for n in returned if n.meta[AMP].source == "placement"]
    assert len(raised) == 2 and all(n.target == torch.ops.aten.dropout.default for n in raised)
    assert all(n.meta[AMP].compute_dtype == torch.float32 for n in raised)
    assert all(not has_cast_role(a) for n in raised for a in n.all_input_nodes)  # softmax's
    for maps, low_maps in zip(out.attentions, as_computed.attentions, strict=True):
        assert (maps.dtype, low_maps.dtype) == (torch.float32, BF16)
        assert torch.equal(maps.to(BF16), low_maps)
        assert not torch.equal(maps, low_maps.float())  # float32's bits, not bf16's
    assert torch.equal(out.last_hidden_state, as_computed.last_hidden_state.float())
    assert grads.keys() == as_computed_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, as_computed_grads[name]), name


def test_the_cut_that_reads_the_outputs_casts_fewer_bytes_than_one_that_did_not():
    """Before the cut read the outputs in float32, cast_outputs' casts came after its
    optimum: on BERT's returned attention maps the graph cast more than the cut said, and
    more than the cut that reads them casts (which is what it says)."""
    model, kwargs = _bert_returning_attentions()
    c = amp_graph.compile(model, o2(False), BF16)
    c(**kwargs)
    blind, blind_stats = replanned(c, True, torch.float32, cut_reads_outputs=False)
    told, told_stats = replanned(c, True, torch.float32)
    assert cast_bytes(blind) > blind_stats["placed_cast_bytes_after"]
    assert cast_bytes(told) == told_stats["placed_cast_bytes_after"]
    assert told_stats["ops_moved_up"] == blind_stats["ops_moved_up"] + 2
    assert told_stats["outputs_cast"] == blind_stats["outputs_cast"] - 2
    assert cast_bytes(told) < cast_bytes(blind)


def test_a_dropout_that_saves_its_noise_is_not_raised():
    """The CPU's dropout multiplies by a noise tensor of its input's dtype and saves it for
    backward: raised, backward would hold the noise in float32. With dropout 0.1 the cut
    leaves the returned maps' dropouts low, and backward holds no more than under the
    rules."""
    held, raised = {}, {}
    for place in (False, True):
        model, kwargs = _bert_returning_attentions(dropout=0.1)
        c = amp_graph.compile(model, o2(place), BF16)
        c(**kwargs)  # captured: the capture's own run holds its own tensors
        params = [*model.parameters(), *model.buffers()]
        held[place], _ = held_for_backward(lambda c=c, k=kwargs: c(**k), exclude=params)
        nodes = c.graph_module.graph.nodes
        raised[place] = {n.name for n in nodes if n.meta[AMP].source == "placement"}
    assert raised[True] == set()  # at dropout 0 the maps' two dropouts are raised (above)
    assert held[True] <= held[False]


class _SoftcapStep(_O2Step):
    """A step whose build computes its loss from the model's logits in the graph."""

    def build(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=tokens).logits
        F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).backward()
        return logits.detach()


def _gemma2() -> tuple[nn.Module, torch.Tensor]:
    """A random HF Gemma-2, which ends in its logit softcap, and its tokens."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma2Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=100,
        max_position_embeddings=64,
        sliding_window=8,
        use_cache=False,
    )
    torch.manual_seed(0)
    tokens = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    return transformers.Gemma2ForCausalLM(config).eval(), tokens


def test_a_steps_own_float32_read_of_the_logits_raises_the_softcaps_last_multiply():
    """HF Gemma-2 ends in its logit softcap (``tanh(logits / cap) * cap``): free ops after
    the head. Compiled, the logits are read once, by the output, in float32: a cast either
    side of the multiply, so the cut keeps it low. In a ``Graph`` whose build computes the
    loss from the logits, they are read twice in float32 (the loss's ``.float()`` and the
    returned value), so the cut raises the multiply: one cast of tanh's output instead of
    two of the logits. The plan follows the program; the values differ only by the last
    rounding (the Graph's are float32's: rounded to bf16 they are compile's)."""
    model, tokens = _gemma2()
    compiled = amp_graph.compile(model, "O2", BF16)
    logits = compiled(input_ids=tokens).logits
    assert _raised(compiled.graph_module) == set()
    step = _SoftcapStep(model, lr=0.0)
    stepped = step(tokens, tokens.roll(-1, 1))
    raised = [n for n in step.build_graph.graph.nodes if n.meta[AMP].source == "placement"]
    assert [n.target for n in raised] == [torch.ops.aten.mul.Tensor]
    assert raised[0].args[0].args[0].target == torch.ops.aten.tanh.default  # through its cast
    assert logits.dtype == stepped.dtype == torch.float32
    assert not torch.equal(stepped, logits)
    assert torch.equal(stepped.to(BF16).float(), logits)


def test_a_detached_value_has_no_gradient_to_cast():
    """``gradient_values``: a value detached in the graph (a Graph's returned logits) has no
    gradient, so a cast of it costs its forward bytes only."""
    from amp_graph.passes.place_casts import gradient_values

    model, tokens = _gemma2()
    step = _SoftcapStep(model, lr=0.0)
    step(tokens, tokens.roll(-1, 1))
    gm = step.build_graph
    with_grad = gradient_values(gm)
    detached = [n for n in gm.graph.nodes if n.target == torch.ops.aten.detach.default]
    assert detached and not any(n in with_grad for n in detached)
    assert all(n.args[0] in with_grad for n in detached)
