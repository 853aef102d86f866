"""amp_graph: automatic mixed precision as a torch.fx graph pass.

>>> import torch, amp_graph
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Softmax(-1))
>>> compiled = amp_graph.compile(model, policy="O1", dtype=torch.bfloat16)
>>> compiled(torch.randn(2, 4)).dtype
torch.float32
"""

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
from amp_graph.training.graph_config import GraphConfig
from amp_graph.training.nn_graph import Graph

__version__ = "0.1.0"

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
