"""Which layers run in fp8: each rule of amp_graph.policy.fp8_filters, its reason, and the order."""

from __future__ import annotations

import pytest
import torch.nn as nn

from amp_graph.policy import Fp8Config, Rule
from amp_graph.policy.fp8_filters import RULES, LinearFacts, decide


def facts(k: int = 64, n: int = 128, path: str = "fc", **kwargs) -> LinearFacts:
    return LinearFacts("aten.linear", path, nn.Linear(k, n), k, n, **kwargs)


def test_eligible_layer_is_fp8_with_its_recipe_in_the_reason():
    decision = decide(facts(), Fp8Config())
    assert decision.fp8
    assert decision.reason.startswith("fp8: aten.linear with K=64, N=128")
    assert "tensorwise" in decision.reason and "e5m2 output gradient" in decision.reason
    assert "e4m3 output gradient" in decide(facts(), Fp8Config(recipe="rowwise")).reason


@pytest.mark.parametrize(
    ("k", "n", "named"), [(60, 128, "in_features=60"), (64, 10, "out_features=10")]
)
def test_dims_not_multiple_of_16_stay_bf16(k, n, named):
    decision = decide(facts(k, n), Fp8Config())
    assert not decision.fp8
    assert decision.reason.startswith(f"not fp8: {named} is not a multiple of 16")


def test_module_filter_receives_module_and_path_and_false_keeps_bf16():
    seen = []

    def keep_head(module, path):
        seen.append((type(module), path))
        return path != "head"

    config = Fp8Config(module_filter=keep_head)
    assert decide(facts(path="blocks.0.fc"), config).fp8
    head = decide(facts(path="head"), config)
    assert not head.fp8 and head.reason == "not fp8: module_filter returned False"
    assert seen == [(nn.Linear, "blocks.0.fc"), (nn.Linear, "head")]


def test_module_filter_must_return_a_bool():
    with pytest.raises(TypeError, match=r"must return True .* or False .* returned 1"):
        decide(facts(), Fp8Config(module_filter=lambda m, p: 1))
    with pytest.raises(TypeError, match=r"fn\(module, path\) -> bool"):
        Fp8Config(module_filter="head")


def test_auto_filter_is_opt_in_and_matches_torchaos_thresholds():
    """torchao's own auto-filter (``_auto_filter_for_recipe``, the thresholds' source) is the
    reference on a grid of layer sizes, for both recipes."""
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

    sizes = [16, 512, 1024, 1040, 2048, 2064, 4096, 4112, 8192]
    assert decide(facts(16, 16), Fp8Config()).fp8  # off by default
    for recipe in ("tensorwise", "rowwise"):
        theirs = _auto_filter_for_recipe(recipe, filter_fqns=[])
        config = Fp8Config(recipe=recipe, auto_filter=True)
        for k in sizes:
            for n in sizes:
                ours = decide(facts(k, n), config)
                assert ours.fp8 == theirs(nn.Linear(k, n, device="meta"), "fc"), (recipe, k, n)
                if not ours.fp8:
                    assert "too small to gain from fp8" in ours.reason


def test_an_explicit_policy_rule_outranks_fp8():
    kept = decide(facts(policy_rule=Rule.DENY, policy_source="module path"), Fp8Config())
    assert not kept.fp8
    assert "rule deny (decided by module path)" in kept.reason
    assert decide(facts(policy_rule=Rule.ALLOW, policy_source="table"), Fp8Config()).fp8


def test_rules_apply_in_their_documented_order():
    names = [rule.__name__ for rule in RULES]
    assert names == [
        "keep_policy_choice",
        "dims_multiple_of_16",
        "user_module_filter",
        "auto_filter",
        "cost_model_filter",
    ]
    # both the dims rule and the filter would keep it: the first one names the reason
    both = decide(facts(64, 10, path="head"), Fp8Config(module_filter=lambda m, p: False))
    assert "out_features=10" in both.reason


def test_unknown_recipe_names_the_valid_ones():
    with pytest.raises(
        ValueError, match=r"unknown fp8 recipe 'delayed'.*\['rowwise', 'tensorwise'\]"
    ):
        Fp8Config(recipe="delayed")
    with pytest.raises(TypeError, match="auto_filter is a bool"):
        Fp8Config(auto_filter="yes")
