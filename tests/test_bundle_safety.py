"""A repro bundle is replayed without running its code (issue 55, part 4).

Bundles are made to be shared. ``amp_graph.replay`` reads every file of one with
``torch.load(weights_only=True)`` and the policy from ``policy.json`` (plain data), so a
bundle someone changed to carry a pickle that runs code is refused, naming the file, and
the code never runs: here, a pickle that would create a file, which must not appear.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_monitor_repro import TrainStep, train

import amp_graph
from amp_graph.inspect.bundle_files import BundleRefused, bundle_policy
from amp_graph.policy import Policy
from amp_graph.policy.fp8_recipe import Fp8Config
from amp_graph.policy.policy_data import PolicyNotData, policy_as_data, policy_from_data


class _CreatesAFile:
    """Unpickled, it creates ``path``: what a tampered bundle could do."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


@pytest.fixture
def bundle(tmp_path):
    monitor, _ = train(tmp_path, TrainStep())
    assert monitor.repro_path is not None
    return monitor.repro_path


def test_a_bundle_holds_its_policy_as_data_and_replays_from_it(bundle) -> None:
    assert not (bundle / "policy.pt").exists()
    data = json.loads((bundle / "policy.json").read_text())
    assert data["name"] == "O1" and policy_from_data(data) == Policy.preset("O1")
    assert amp_graph.replay(bundle, TrainStep(), numerics=False).reproduced


@pytest.mark.parametrize("name", ["batch.pt", "state.pt", "rng.pt", "step_result.pt"])
def test_a_tampered_file_is_refused_by_name_and_runs_no_code(bundle, tmp_path, name) -> None:
    target = tmp_path / "created_by_the_bundle"
    torch.save({"payload": _CreatesAFile(str(target))}, bundle / name)
    with pytest.raises(BundleRefused) as raised:
        amp_graph.replay(bundle, TrainStep(), numerics=False)
    assert str(bundle / name) in str(raised.value) and "add_safe_globals" in str(raised.value)
    assert not target.exists()


def test_a_tampered_policy_is_refused_by_name(bundle) -> None:
    """The policy a compiled module's bundle is replayed under (``bundle_policy``)."""
    meta = json.loads((bundle / "meta.json").read_text())
    assert bundle_policy(bundle, meta) == Policy.preset("O1")
    data = json.loads((bundle / "policy.json").read_text())
    data["module_types"] = {"os:system": "deny"}  # a name, never called: not a module type
    (bundle / "policy.json").write_text(json.dumps(data))
    with pytest.raises(BundleRefused, match=r"policy\.json.*os:system is not a subclass of"):
        bundle_policy(bundle, meta)


def _ship_code(bundle, monkeypatch, marker) -> str:
    """A module the bundle carries beside its files, importable as a package under the
    current directory (on sys.path, as under ``python -m`` or in a notebook): importing it
    creates ``marker``. Returns its module name."""
    (bundle / "payload.py").write_text(
        f"import os\nos.mkdir({str(marker)!r})\nimport torch.nn as nn\n"
        "class Net(nn.Module):\n    pass\n"
    )
    monkeypatch.chdir(bundle.parent.parent)
    monkeypatch.syspath_prepend(str(bundle.parent.parent))
    return f"{bundle.parent.name}.{bundle.name}.payload"


@pytest.mark.parametrize("where", ["graph_class", "policy"])
def test_a_class_a_bundle_names_from_code_it_ships_is_never_imported(
    bundle, tmp_path, monkeypatch, where
) -> None:
    """Importing runs a module: a bundle naming a module it carries (as its Graph class, or a
    policy's module type) had it imported by replay, which ran it. Names are now looked up
    among the modules this process imported, and the code never runs."""
    marker = tmp_path / "ran"
    module = _ship_code(bundle, monkeypatch, marker)
    meta = json.loads((bundle / "meta.json").read_text())
    if where == "graph_class":
        meta["graph_class"] = f"{module}:Net"
        (bundle / "meta.json").write_text(json.dumps(meta))
        with pytest.raises(TypeError, match=r"has not imported.*pass graph="):
            amp_graph.replay(bundle, numerics=False)
    else:
        data = json.loads((bundle / "policy.json").read_text())
        data["module_types"] = {f"{module}:Net": "deny"}
        (bundle / "policy.json").write_text(json.dumps(data))
        with pytest.raises(BundleRefused, match=r"has not imported"):
            bundle_policy(bundle, meta)
    assert not marker.exists()


def test_a_recorded_class_that_is_no_graph_is_not_called(bundle, monkeypatch) -> None:
    """``graph_class`` naming any zero-argument callable of an imported module
    (``tempfile:mkdtemp``) had replay call it; a name that is not a Graph subclass is
    refused before any call."""
    import tempfile

    made: list[str] = []
    monkeypatch.setattr(tempfile, "mkdtemp", lambda: made.append("called"))
    meta = json.loads((bundle / "meta.json").read_text())
    meta["graph_class"] = "tempfile:mkdtemp"
    (bundle / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(TypeError, match=r"tempfile:mkdtemp is not a subclass of Graph"):
        amp_graph.replay(bundle, numerics=False)
    assert made == []


def test_policies_round_trip_through_data() -> None:
    policies = [Policy.preset(name) for name in ("O0", "O1", "O2", "O3", "autocast", "fp8")]
    policies.append(
        Policy.preset("O2").override(
            modules={"blocks.*.attn": "deny"},
            ops={F.softmax: "allow", nn.LayerNorm: "allow", torch.Tensor.softmax: "allow"},
            nodes={"linear_3": "deny"},
        )
    )
    policies.append(Policy.preset("O1").override(ops={torch.ops.aten.mm.default: "deny"}))
    policies.append(dataclasses.replace(Policy.preset("O1"), output_dtype=torch.float32))
    stored_fields: set[str] = set()
    for policy in policies:
        stored = json.loads(json.dumps(policy_as_data(policy)))
        assert policy_from_data(stored) == policy, policy.name
        stored_fields |= set(stored)
    # every field of a Policy is stored: a field added later and forgotten here fails
    assert {f.name for f in dataclasses.fields(Policy)} <= stored_fields
    with pytest.raises(ValueError, match="output_dtype is null or 'float32'"):
        policy_from_data({**policy_as_data(policies[-1]), "output_dtype": "float16"})


def test_a_policy_holding_a_function_is_not_data_and_the_bundle_keeps_its_text() -> None:
    def mine(x):
        return x

    with pytest.raises(PolicyNotData, match="function of your own"):
        policy_as_data(Policy.preset("O1").override(ops={mine: "deny"}))
    fp8 = Policy.preset("fp8")
    fp8 = type(fp8)(**{**fp8.__dict__, "fp8": Fp8Config(module_filter=lambda m, p: True)})
    with pytest.raises(PolicyNotData, match="module_filter"):
        policy_as_data(fp8)


def test_a_policy_kept_as_text_only_asks_for_policy(bundle) -> None:
    meta = json.loads((bundle / "meta.json").read_text())
    (bundle / "policy.json").unlink()  # as for a policy holding a function
    with pytest.raises(ValueError, match=r"text only.*policy=\.\.\."):
        bundle_policy(bundle, meta)
    with pytest.raises(TypeError, match="Graph's bundle: pass graph="):
        amp_graph.replay(bundle, policy=Policy.preset("O1"))
