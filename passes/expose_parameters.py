"""Pass 2, expose_parameters: make the parameters of cast modules graph values.

torch.autocast casts a module's weight because the weight is an argument of the aten op.
In an FX graph a leaf module hides its parameters inside ``call_module``. This pass
rewrites each leaf module whose parameters must change dtype under its rule into an
explicit call, so that ``insert_casts`` can cast each parameter once per call:

* stateless layers become their functional form: ``self.fc(x)`` ->
  ``F.linear(x, self.fc.weight, self.fc.bias)``;
* anything else (RNNs, attention, unknown modules) becomes
  ``torch.func.functional_call(self.lstm, {"weight_ih_l0": <param>, ...}, (x,))``, which runs
  the module's own forward with the given parameters (its training flag and buffers stay
  the module's).

Reads: ``meta["amp"].rule``. Writes: new ``get_attr`` nodes (``role=PARAM``) and the
replacement call, which inherits the original node's ``meta["amp"]`` and
``meta["nn_module_stack"]``. Guarantees: the rewritten call computes what the module call
computed (same parameter objects, no copies); modules whose kernels take low-precision
inputs with float32 parameters (batch norm) are left alone.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from amp_graph.policy import Rule

from .meta import AMP, CASTABLE, AmpInfo, Role
from .result import PassResult

# Kernels that accept a low-precision input with float32 weights and running statistics:
# casting the input is enough, so the module stays a module.
MIXED_PRECISION_MODULES: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._BatchNorm,)

Call = tuple[Callable, tuple]
Emit = Callable[[fx.Node, nn.Module, dict[str, fx.Node]], Call]


def _linear(x: fx.Node, m: nn.Linear, p: dict[str, fx.Node]) -> Call:
    return F.linear, (x, p["weight"], p.get("bias"))


def _conv(x: fx.Node, m: nn.modules.conv._ConvNd, p: dict[str, fx.Node]) -> Call:
    fn = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[len(m.kernel_size)]
    return fn, (x, p["weight"], p.get("bias"), m.stride, m.padding, m.dilation, m.groups)


def _layer_norm(x: fx.Node, m: nn.LayerNorm, p: dict[str, fx.Node]) -> Call:
    return F.layer_norm, (x, m.normalized_shape, p.get("weight"), p.get("bias"), m.eps)


def _group_norm(x: fx.Node, m: nn.GroupNorm, p: dict[str, fx.Node]) -> Call:
    return F.group_norm, (x, m.num_groups, p.get("weight"), p.get("bias"), m.eps)


def _rms_norm(x: fx.Node, m: nn.Module, p: dict[str, fx.Node]) -> Call:
    return F.rms_norm, (x, m.normalized_shape, p.get("weight"), m.eps)


def _embedding(x: fx.Node, m: nn.Embedding, p: dict[str, fx.Node]) -> Call:
    return F.embedding, (
        x,
        p["weight"],
        m.padding_idx,
        None,
        m.norm_type,
        m.scale_grad_by_freq,
        m.sparse,
    )


def _prelu(x: fx.Node, m: nn.PReLU, p: dict[str, fx.Node]) -> Call:
    return F.prelu, (x, p["weight"])


def _functional_form(module: nn.Module) -> Emit | None:
    """The functional rewrite for a module, when it exists and is exactly equivalent."""
    if type(module) is nn.Linear:
        return _linear
    if type(module) in (nn.Conv1d, nn.Conv2d, nn.Conv3d) and module.padding_mode == "zeros":
        return _conv
    if type(module) is nn.LayerNorm:
        return _layer_norm
    if type(module) is nn.GroupNorm:
        return _group_norm
    if type(module) is nn.Embedding and module.max_norm is None:  # max_norm renorms in place
        return _embedding
    if type(module) is nn.PReLU:
        return _prelu
    if hasattr(nn, "RMSNorm") and type(module) is nn.RMSNorm:
        return _rms_norm
    return None


def _needs_parameter_casts(module: nn.Module, rule: Rule | None, low: torch.dtype) -> bool:
    if rule in (None, Rule.FOLLOW) or isinstance(module, MIXED_PRECISION_MODULES):
        return False
    target = torch.float32 if rule is Rule.DENY else low
    return any(p.dtype in CASTABLE and p.dtype != target for p in module.parameters())


def _param_node(graph: fx.Graph, qualified: str, tensor: torch.Tensor, path: str) -> fx.Node:
    node = graph.get_attr(qualified)
    node.meta[AMP] = AmpInfo.fixed(
        Role.PARAM,
        "get_attr",
        "a parameter of the model",
        module_path=path,
        out_dtype=tensor.dtype,
        exact=True,
    )
    return node


def expose_parameters(gm: fx.GraphModule, low_dtype: torch.dtype) -> PassResult:
    """Rewrite leaf modules whose parameters must be cast into explicit calls.

    >>> import torch, torch.fx as fx, amp_graph
    >>> from amp_graph.passes import classify
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    >>> _ = classify(gm, amp_graph.Policy.preset("O1"))
    >>> _ = expose_parameters(gm, torch.bfloat16)
    >>> [n.op for n in gm.graph.nodes]
    ['placeholder', 'get_attr', 'get_attr', 'call_function', 'output']
    """
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or node.meta[AMP].role is not Role.OP:
            continue
        module = gm.get_submodule(node.target)
        if not _needs_parameter_casts(module, node.meta[AMP].rule, low_dtype):
            continue
        emit = _functional_form(module)
        if emit is not None and (len(node.args) != 1 or node.kwargs):
            emit = None  # only the plain single-input call maps onto the functional form
        with gm.graph.inserting_before(node):
            params = {
                name: _param_node(gm.graph, f"{node.target}.{name}", p, node.target)
                for name, p in module.named_parameters()
            }
            if emit is not None:
                target, args = emit(node.args[0], module, params)
            else:
                owner = gm.graph.get_attr(node.target)
                owner.meta[AMP] = AmpInfo.fixed(
                    Role.OTHER, "get_attr", "the module whose forward runs", module_path=node.target
                )
                target = torch.func.functional_call
                args = (owner, params, tuple(node.args), dict(node.kwargs))
            new = gm.graph.create_node("call_function", target, args, {})
        new.meta = copy.copy(node.meta)
        new.meta[AMP] = copy.copy(node.meta[AMP])
        new.meta[AMP].detail += f" (module {node.target!r} called with its parameters exposed)"
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        new.name = node.name  # keep the name users saw in the traced graph; it is free now
        rewritten += 1
    return PassResult(gm, modified=bool(rewritten), stats={"modules_exposed": rewritten})
