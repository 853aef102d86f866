"""One front door (amp_graph.frontends.front_door): every entry point runs one sequence, the
request admitted, the graph captured, then rewritten, and each says once what it needs.

The sequence is checked on the source: the steps of the chain (resolving the policy, the
CPU's slow-product warning, matching overrides, running the passes) are called from the
front door alone, and every entry point calls :func:`admit`. The check also runs on a
made-up module that copies a step, so that a check which has stopped seeing calls fails.
Then what the entry points ask for, each with its effect: the warning at the user's line
however deep the entry point, hooks only where the graph runs as it is.
"""

from __future__ import annotations

import ast
import dataclasses
import gc
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import amp_graph
from amp_graph.capture import capture_for_policy
from amp_graph.frontends import cpu_low_speed, front_door
from amp_graph.frontends.policy_request import AmpRequest
from amp_graph.ops import recompute_ops

ROOT = Path(__file__).resolve().parent.parent
BF16, FP32 = torch.bfloat16, torch.float32

# the chain's steps, each called from the front door alone
STEPS = (
    "resolve",
    "warn_if_low_matmul_is_slow",
    "validate_module_overrides",
    "validate_node_overrides",
    "run_passes",
    "inline_regions",
)
FRONT_DOOR = "amp_graph/frontends/front_door.py"
# check_request also runs where the user states the request, so that a bad preset or dtype
# fails at that line: backend(...) and config.enable_amp(...)
STATED_AT = {
    ("amp_graph/frontends/dynamo_backend.py", "backend"),
    ("amp_graph/training/graph_config.py", "enable_amp"),
}
ENTRY_POINTS = {
    ("amp_graph/frontends/compiler.py", "compile"),
    ("amp_graph/frontends/dynamo_backend.py", "_compile"),  # __call__ warns around it
    ("amp_graph/training/step_builder.py", "_capture"),
    ("amp_graph/deploy/program.py", "export"),
    ("amp_graph/accuracy/autopolicy_search.py", "autopolicy"),
    ("amp_graph/frontends/cached_decode.py", "_admitted"),  # calls with a KV cache
}


def _from_amp_graph(node: ast.Import | ast.ImportFrom, name: str) -> bool:
    if isinstance(node, ast.ImportFrom):
        return bool(node.level) or (node.module or "").startswith("amp_graph")
    return name.startswith("amp_graph")


def calls_by_function(source: str, names: set[str]) -> set[tuple[str, str]]:
    """(called name, enclosing function) for each call of one of ``names``: by bare name, or
    as an attribute of what the module imported from amp_graph (``policy_request.resolve``;
    not ``path.resolve()`` nor a method of ``self``)."""
    tree = ast.parse(source)
    from_amp_graph = {
        alias.asname or alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
        if _from_amp_graph(node, alias.name)
    }
    found: set[tuple[str, str]] = set()

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = function
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = child.name
            if isinstance(child, ast.Call):
                called = child.func
                name = None
                if isinstance(called, ast.Name):
                    name = called.id
                elif (
                    isinstance(called, ast.Attribute)
                    and isinstance(called.value, ast.Name)
                    and called.value.id in from_amp_graph
                ):
                    name = called.attr
                if name in names:
                    found.add((name, function))
            visit(child, inner)

    visit(tree, "<module>")
    return found


def callers(names: set[str]) -> dict[str, set[tuple[str, str]]]:
    """name -> {(file, function)} over amp_graph/ and passes/."""
    by_name: dict[str, set[tuple[str, str]]] = {name: set() for name in names}
    for path in sorted([*ROOT.glob("amp_graph/**/*.py"), *ROOT.glob("passes/**/*.py")]):
        if path.is_symlink() or any(p.is_symlink() for p in path.parents if ROOT in p.parents):
            continue  # a worktree's amp_graph/passes link: passes/ is read once, as itself
        relative = path.relative_to(ROOT).as_posix()
        for name, function in calls_by_function(path.read_text(), names):
            by_name[name].add((relative, function))
    return by_name


def test_the_check_sees_a_copied_step() -> None:
    made_up = (
        "from amp_graph.frontends import policy_request\n"
        "def my_entry(policy):\n"
        "    request = policy_request.resolve(policy, None, 'cpu')\n"
        "    self.resolve(request)\n"  # a method of its own: not the step
        "    path.resolve()\n"  # nor pathlib's
        "    return run_passes(gm, request.policy, request.dtype)\n"
    )
    assert calls_by_function(made_up, set(STEPS)) == {
        ("resolve", "my_entry"),
        ("run_passes", "my_entry"),
    }


def test_the_entry_sequence_is_written_once() -> None:
    found = callers({*STEPS, "check_request", "admit"})
    for step in STEPS:
        outside = {(file, fn) for file, fn in found[step] if file != FRONT_DOOR}
        assert not outside, f"{step} is called outside the front door: {sorted(outside)}"
        assert found[step], f"the front door no longer calls {step}"
    assert {caller for caller in found["check_request"] if caller[0] != FRONT_DOOR} == STATED_AT
    missing = ENTRY_POINTS - found["admit"]
    assert not missing, f"entry points that do not admit their request: {sorted(missing)}"


@pytest.fixture
def slow_bfloat16(monkeypatch):
    """bfloat16 products measured 20x float32's: the CPU warning is due."""
    times = {BF16: 2.0e-3, FP32: 1.0e-4}
    monkeypatch.setattr(cpu_low_speed, "_measure", lambda dtype: (times[dtype], times[FP32]))
    cpu_low_speed.forget()
    yield
    cpu_low_speed.forget()


def _slow(caught) -> list[warnings.WarningMessage]:
    return [w for w in caught if "matrix product takes" in str(w.message)]


class _Forward(amp_graph.Graph):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.config.enable_amp(True, policy="O1", dtype=BF16)

    def build(self, x):
        return self.model(x)


def _entry_points():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    x = torch.randn(2, 8)
    return {
        "compile": lambda: amp_graph.compile(model, "O1", BF16, example_inputs=(x,)),
        "Graph": lambda: _Forward(model)(x),
        "autopolicy": lambda: amp_graph.autopolicy(model, "O1", BF16, sample_inputs=[(x,)]),
    }


@pytest.mark.parametrize("entry", ["compile", "Graph", "autopolicy"])
def test_the_slow_product_warning_points_at_the_users_line(slow_bfloat16, entry) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _entry_points()[entry]()
    (warning,) = _slow(caught)
    assert warning.filename == __file__, (warning.filename, warning.lineno)


def _recomputing_graph(policy: amp_graph.Policy) -> tuple[torch.fx.GraphModule, AmpRequest]:
    """A linear captured under ``policy`` with recompute_casts=True: the passes recompute its
    weight's cast in backward."""
    model = nn.Sequential(nn.Linear(8, 8))
    request = front_door.admit(dataclasses.replace(policy, recompute_casts=True), BF16, model)
    captured = capture_for_policy(
        model, (torch.randn(2, 8),), {}, request.policy, BF16, device_type="cpu"
    )
    return captured.graph_module, request


@pytest.mark.parametrize("hooks", [True, False])
def test_recompute_hooks_are_installed_only_where_the_graph_runs_as_it_is(hooks) -> None:
    gm, request = _recomputing_graph(amp_graph.Policy.preset("O1"))
    record = front_door.rewrite(gm, request, recompute_hooks=hooks)
    assert record.stats["casts_recomputed"] > 0
    assert (recompute_ops._HANDLES in gm.__dict__) is hooks
    assert record.recompute_cost is None  # recompute_casts=True: nothing weighed


def test_node_overrides_are_matched_unless_the_graph_is_one_piece() -> None:
    misspelled = amp_graph.Policy.preset("O1").override(nodes={"adddmm": "fp32"})
    gm, request = _recomputing_graph(misspelled)
    with pytest.raises(ValueError, match="adddmm"):
        front_door.rewrite(gm, request)
    gm, request = _recomputing_graph(misspelled)
    record = front_door.rewrite(gm, request, check_nodes=False)  # the backend's graphs
    assert "adddmm" in record.policy.nodes


def test_graph_is_a_facade_over_its_step_builder() -> None:
    """Graph is what users read (registration, config, build, calling, state): at most 300
    lines, and no capture of its own: the step builder goes through the front door."""
    source = (ROOT / "amp_graph/training/nn_graph.py").read_text()
    tree = ast.parse(source)
    (graph,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Graph"]
    assert graph.end_lineno - graph.lineno + 1 <= 300
    imported = {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    }
    assert not {m for m in imported if m.startswith(("amp_graph.capture", "amp_graph.frontends"))}
    methods = {n.name for n in graph.body if isinstance(n, ast.FunctionDef)}
    assert {"add_optimizer", "set_grad_scaler", "build", "__call__", "state_dict"} <= methods
    assert not methods & {"_capture", "_root", "_step_graph", "_start_replayer"}


def test_the_passes_run_with_the_collector_off_and_leave_it_as_it_was(monkeypatch) -> None:
    """A full collection walks every live object, so with the collector on the passes' time
    per node grew with the graph (1.45x from 1.6k to 16k nodes, benchmarks/pass_bench.py)."""
    seen = []
    run_passes = front_door.run_passes

    def recording(*args, **kwargs):
        seen.append(gc.isenabled())
        return run_passes(*args, **kwargs)

    monkeypatch.setattr(front_door, "run_passes", recording)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    amp_graph.compile(model, "O1", BF16, example_inputs=(torch.randn(2, 4),))
    assert seen == [False] and gc.isenabled()
