"""amp_graph: automatic mixed precision as a torch.fx graph pass.

>>> import torch, amp_graph
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Softmax(-1))
>>> compiled = amp_graph.compile(model, policy="O1", dtype=torch.bfloat16)
>>> compiled(torch.randn(2, 4)).dtype
torch.float32
"""

import importlib
import sys
import types
import warnings

from amp_graph import deploy, inspect, passes
from amp_graph.accuracy.autopolicy_search import AutopolicyError, autopolicy
from amp_graph.deploy import export, export_info
from amp_graph.frontends.compiler import CaptureError, CompiledModule, compile, compile_, uncompile
from amp_graph.frontends.dynamo_backend import AmpGraphBackend, backend, captured_graphs
from amp_graph.frontends.graphed_calls import CudaGraphError
from amp_graph.inspect import dataflow, diff, draw
from amp_graph.inspect.numerics import NumericsReport, numerics
from amp_graph.inspect.replay import ReplayResult, replay
from amp_graph.inspect.report import Report, explain, report
from amp_graph.monitoring import History, Monitor, monitor
from amp_graph.policy import KEEP_FP32, PRESETS, Policy, Rule
from amp_graph.scaler import GradScaler, StaticGradScaler
from amp_graph.training.fsdp_plan import FSDPPlan, plan_fsdp
from amp_graph.training.nn_graph import Graph, GraphConfig

__version__ = "0.1.0"

# Old module paths, from before the modules moved into the folders of their layers (README,
# "How the code is laid out"). Each still imports; reading a name through it warns once per
# place with a DeprecationWarning naming the new module. A tuple: the names of one old module
# now live in several.
MOVED_MODULES: dict[str, str | tuple[str, ...]] = {
    "amp_graph.amp_request": "amp_graph.frontends.policy_request",
    "amp_graph.autopolicy": "amp_graph.accuracy.autopolicy_search",
    "amp_graph.backend": "amp_graph.frontends.dynamo_backend",
    "amp_graph.capture_casts": "amp_graph.capture.casts",
    "amp_graph.capture_dtypes": "amp_graph.capture.planned_dtypes",
    "amp_graph.capture_fsdp": "amp_graph.capture.fsdp_units",
    "amp_graph.compiler": "amp_graph.frontends.compiler",
    "amp_graph.cpu_kernels": "amp_graph.frontends.cpu_low_kernels",
    "amp_graph.data": "amp_graph.demo.digits",
    "amp_graph.fp8": (
        "amp_graph.policy.fp8_recipe",
        "amp_graph.policy.fp8_filters",
        "amp_graph.ops.fp8_ops",
    ),
    "amp_graph.fp8.cpu_matmul": "amp_graph.ops.fp8_cpu_matmul",
    "amp_graph.fp8.custom_ops": "amp_graph.ops.fp8_ops",
    "amp_graph.fp8.filters": "amp_graph.policy.fp8_filters",
    "amp_graph.fp8.recipe": "amp_graph.policy.fp8_recipe",
    "amp_graph.fsdp_plan": "amp_graph.training.fsdp_plan",
    "amp_graph.graph": "amp_graph.training.nn_graph",
    "amp_graph.kernels": "amp_graph.ops",
    "amp_graph.kernels.cpu_extension": "amp_graph.ops.cpu_extension",
    "amp_graph.kernels.extension": "amp_graph.ops.cuda_extension",
    "amp_graph.kernels.scaler_ops": "amp_graph.ops.scaler_ops",
    "amp_graph.lightning": "amp_graph.integrations.lightning",
    "amp_graph.master_weights": "amp_graph.training.master_weights",
    "amp_graph.models": "amp_graph.demo.models",
    "amp_graph.output_error": "amp_graph.accuracy.float32_error",
    "amp_graph.recompute": "amp_graph.ops.recompute_ops",
    "amp_graph.rule": "amp_graph.policy.precision_policy",
    "amp_graph.scaler.monitor": "amp_graph.scaler.skip_monitor",
    "amp_graph.shadow": "amp_graph.accuracy.shadow",
    "amp_graph.step_graph": "amp_graph.training.step_graph",
    "amp_graph.step_ops": "amp_graph.training.step_ops",
    "amp_graph.tables": "amp_graph.policy",
    "amp_graph.tables.autocast_lists": "amp_graph.policy.autocast_lists",
    "amp_graph.tables.python_ops": "amp_graph.policy.python_ops",
    "amp_graph.tensor_stats": "amp_graph.ops.tensor_stats",
}


class _MovedModule(types.ModuleType):
    """An old module path: reads a name from the module(s) that now hold it, and warns."""

    def __init__(self, name: str, targets: tuple[str, ...]) -> None:
        super().__init__(name, f"Moved: import from {' or '.join(targets)}.")
        self._targets = targets

    def __getattr__(self, attr: str) -> object:
        if attr.startswith("__"):  # sys.modules scans (pickle, inspect) must import nothing
            raise AttributeError(attr)
        child = _moved_module(f"{self.__name__}.{attr}")
        if child is not None:
            return child
        for target in self._targets:
            module = importlib.import_module(target)
            if hasattr(module, attr):
                warnings.warn(
                    f"{self.__name__} moved: import {attr} from {target}",
                    DeprecationWarning,
                    stacklevel=2,
                )
                return getattr(module, attr)
        raise AttributeError(f"module {self.__name__!r} (moved to {self._targets}) has no {attr!r}")

    def __dir__(self) -> list[str]:
        return sorted({n for t in self._targets for n in dir(importlib.import_module(t))})


def _moved_module(name: str) -> _MovedModule | None:
    module = sys.modules.get(name)
    return module if isinstance(module, _MovedModule) else None


def _install_moved_modules() -> None:
    # In sys.modules before anyone asks, so that `import amp_graph.backend` finds the module
    # without setting the attribute amp_graph.backend, which is the function. An old path
    # under a package that still exists (amp_graph.scaler.monitor) is also its attribute; this
    # package answers through __getattr__, an old package through its own alias.
    for old, new in MOVED_MODULES.items():
        targets = new if isinstance(new, tuple) else (new,)
        moved = sys.modules.setdefault(old, _MovedModule(old, targets))
        parent, _, child = old.rpartition(".")
        owner = sys.modules.get(parent)
        real_package = parent != __name__ and owner is not None and not _moved_module(parent)
        if real_package and not hasattr(owner, child):
            setattr(owner, child, moved)


def __getattr__(name: str) -> object:
    moved = _moved_module(f"{__name__}.{name}")
    if moved is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return moved


_install_moved_modules()

__all__ = [
    "KEEP_FP32",
    "PRESETS",
    "AmpGraphBackend",
    "AutopolicyError",
    "CaptureError",
    "CompiledModule",
    "CudaGraphError",
    "FSDPPlan",
    "GradScaler",
    "Graph",
    "GraphConfig",
    "History",
    "Monitor",
    "NumericsReport",
    "Policy",
    "ReplayResult",
    "Report",
    "Rule",
    "StaticGradScaler",
    "autopolicy",
    "backend",
    "captured_graphs",
    "compile",
    "compile_",
    "dataflow",
    "deploy",
    "diff",
    "draw",
    "explain",
    "export",
    "export_info",
    "inspect",
    "monitor",
    "numerics",
    "passes",
    "plan_fsdp",
    "replay",
    "report",
    "uncompile",
]
