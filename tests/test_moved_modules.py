"""The layout change (issue 40) breaks no user: every public name is where it was, and every
old module path still imports, warning once per place with the module that now holds it.

The new paths are checked against the old ones name by name: what an old path gives is the very
object the new module holds, never a copy, so ``isinstance`` and monkeypatching keep working.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys
import warnings

import pytest
import torch
from test_layering import layer_of, module_files

import amp_graph
from amp_graph import MOVED_MODULES

PUBLIC = {  # name -> the module that defines it now
    "compile": "amp_graph.frontends.compiler",
    "compile_": "amp_graph.frontends.compiler",
    "uncompile": "amp_graph.frontends.compiler",
    "CompiledModule": "amp_graph.frontends.compiler",
    "backend": "amp_graph.frontends.dynamo_backend",
    "Graph": "amp_graph.training.nn_graph",
    "GradScaler": "amp_graph.scaler.grad_scaler",
    "Policy": "amp_graph.policy.precision_policy",
    "Rule": "amp_graph.policy.precision_policy",
    "export": "amp_graph.deploy.program",
    "monitor": "amp_graph.monitoring",
    "replay": "amp_graph.inspect.replay",
    "plan_fsdp": "amp_graph.training.fsdp_plan",
    "explain": "amp_graph.inspect.report",
    "report": "amp_graph.inspect.report",
    "autopolicy": "amp_graph.accuracy.autopolicy_search",
    "draw": "amp_graph.inspect.drawing",
    "diff": "amp_graph.inspect.pass_diff",
    "dataflow": "amp_graph.inspect.module_flow",
}


def _targets(old: str) -> tuple[str, ...]:
    new = MOVED_MODULES[old]
    return new if isinstance(new, tuple) else (new,)


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_names_stay_at_the_top(name):
    value = getattr(amp_graph, name)
    assert value.__module__ == PUBLIC[name]
    assert getattr(importlib.import_module(PUBLIC[name]), name) is value
    assert name in amp_graph.__all__


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_an_old_module_path_gives_the_new_objects_and_warns(old):
    new_modules = [importlib.import_module(t) for t in _targets(old)]
    public = [n for n in dir(new_modules[0]) if not n.startswith("_")]
    assert public, f"{_targets(old)[0]} has no public name to read through {old}"
    name = public[0]
    moved = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=f"{old} moved: import {name} from "):
        value = getattr(moved, name)
    assert value is getattr(new_modules[0], name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="has no 'no_such_name'"):
            _ = moved.no_such_name
    assert set(public) <= set(dir(moved))


def test_from_import_through_an_old_path(recwarn):
    pytest.importorskip("lightning")
    from amp_graph.lightning import AmpGraphPrecision

    from amp_graph.integrations.lightning import AmpGraphPrecision as new

    assert AmpGraphPrecision is new
    [warning] = [w for w in recwarn if "moved:" in str(w.message)]
    assert "import AmpGraphPrecision from amp_graph.integrations.lightning" in str(warning.message)
    assert warning.filename == __file__  # the warning points at the user's import line


def test_an_old_package_path_reads_its_old_modules():
    import amp_graph.kernels.scaler_ops

    from amp_graph.ops import scaler_ops

    with pytest.warns(DeprecationWarning, match="amp_graph.kernels.scaler_ops moved"):
        assert amp_graph.kernels.scaler_ops.update_scale_ is scaler_ops.update_scale_
    from amp_graph.ops import fp8_ops
    from amp_graph.policy import fp8_filters, fp8_recipe

    with pytest.warns(DeprecationWarning):  # one old module, now three: each name finds its own
        fp8 = amp_graph.fp8
        assert (fp8.Fp8Config, fp8.decide, fp8.linear) == (
            fp8_recipe.Fp8Config,
            fp8_filters.decide,
            fp8_ops.linear,
        )
    with pytest.warns(DeprecationWarning, match="amp_graph.scaler.monitor moved"):
        assert amp_graph.scaler.monitor.SkipMonitor is not None


def test_a_module_path_under_a_function_name_leaves_the_function():
    """``amp_graph.backend`` is the function; its old module path still imports."""
    import amp_graph.backend

    from amp_graph.frontends import dynamo_backend

    with pytest.warns(
        DeprecationWarning, match="import amp_graph_backend from amp_graph.frontends"
    ):
        from amp_graph.backend import amp_graph_backend
    assert amp_graph_backend is dynamo_backend.amp_graph_backend
    assert callable(amp_graph.backend) and amp_graph.backend is dynamo_backend.backend
    assert amp_graph.autopolicy.__module__ == "amp_graph.accuracy.autopolicy_search"


def test_the_backend_entry_point_names_the_new_module():
    [entry] = importlib.metadata.entry_points(group="torch_dynamo_backends", name="amp_graph")
    assert entry.value == "amp_graph.frontends.dynamo_backend:amp_graph_backend"
    from amp_graph.frontends.dynamo_backend import amp_graph_backend

    assert entry.load() is amp_graph_backend
    compiled = torch.compile(torch.nn.Linear(2, 2), backend="amp_graph")
    assert compiled(torch.randn(1, 2)).shape == (1, 2)


def test_old_paths_cost_nothing_until_read():
    """Importing amp_graph imports none of the moved modules' optional dependencies, and a
    scan of sys.modules (as pickle and inspect do) triggers no import and no warning."""
    code = (
        "import sys, warnings\n"
        "warnings.simplefilter('error')\n"
        "import amp_graph, pickle, inspect\n"
        "assert 'lightning' not in sys.modules\n"
        "for m in list(sys.modules.values()):\n"
        "    getattr(m, '__file__', None); getattr(m, '__spec__', None)\n"
        "pickle.dumps(amp_graph.Policy.preset('O1'))\n"
        "assert 'lightning' not in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_every_old_path_points_into_a_layer_folder():
    modules = module_files()
    for old in MOVED_MODULES:
        assert old not in modules, f"{old} is a file again and an old path at once"
        for target in _targets(old):
            assert target in modules and layer_of(target) is not None, target
            assert modules[target].parent.name != "amp_graph", f"{target}: a flat module"
