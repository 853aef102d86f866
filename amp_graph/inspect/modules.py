"""Which module each node of a graph belongs to, and what type each module is.

Tracing records the module an op ran in (``nn_module_stack``, which classify turns into
``meta["amp"].module_path``), but not every node is an op that ran in a module:

* ``torch.export`` reads parameters and buffers as ``get_attr`` nodes
  (``model_attn_q_weight`` reading ``self.model.attn.q.weight``) and dynamo lifts them to
  graph inputs (``l_self_modules_attn_modules_q_parameters_weight_``); neither records a
  module. A parameter belongs to the module that owns it (``attn.q``).
* A cast amp_graph inserted belongs where its input does (insert_casts' convention), and
  a cast of a parameter to the module that uses it (the innermost module holding all its
  consumers), so the casts of a module's weights count in that module, tied weights in
  the module that casts them (``head``, not ``tok``).
* Export marks the nodes it creates outside any module (``sym_size``) with a placeholder
  stack entry, ``_empty_nn_module_stack_from_metadata_hook``: they belong to no module.
"""

from __future__ import annotations

import re

import torch.fx as fx

from amp_graph.passes.classify import lifted_source_name, normalize_module_path
from amp_graph.passes.meta import AMP, MODEL_ROOT, NO_MODULE, Role, model_root

_STATE_SUFFIX = re.compile(r"(^|\.)_(parameters|buffers)\.[^.]+$")


def _state_owner(node: fx.Node, root: str) -> str:
    """The module owning the parameter or buffer ``node`` reads ("" for the root's own)."""
    if node.op == "get_attr":
        target = str(node.target)
        if root and target.startswith(f"{root}."):
            target = target[len(root) + 1 :]
        return target.rpartition(".")[0]
    name = lifted_source_name(node)  # dynamo's lifted state
    if not name:
        return ""
    path = normalize_module_path(name)  # blocks.0.attn._parameters.weight
    return _STATE_SUFFIX.sub("", path) if _STATE_SUFFIX.search(path) else ""


def node_modules(gm: fx.GraphModule) -> dict[str, str]:
    """Node name -> the module path the inspection tools file the node under ("" for none).

    The node's ``meta["amp"].module_path`` where it has one; parameters and buffers under
    the module that owns them, inserted casts under their input's module (module doc).

    >>> import torch, amp_graph
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4))
    >>> c = amp_graph.compile(m, example_inputs=(torch.randn(2, 4),))
    >>> paths = node_modules(c.graph_module)
    >>> paths["model_0_weight"], paths["model_0_weight_bf16"], paths["linear"], paths["input_1"]
    ('0', '0', '0', '')
    """
    root = getattr(gm, "meta", {}).get(MODEL_ROOT, "")
    paths: dict[str, str] = {}
    casts: list[fx.Node] = []
    for node in gm.graph.nodes:
        amp = node.meta[AMP]
        path = "" if amp.module_path == NO_MODULE else amp.module_path
        if not path and amp.role is Role.PARAM:
            path = _state_owner(node, root)
        elif not path and amp.role is Role.CAST and node.all_input_nodes:
            casts.append(node)  # after its consumers, which come later in the graph
        paths[node.name] = path
    for cast in casts:
        source = cast.all_input_nodes[0]
        users = [paths[u.name] for u in cast.users if u.op != "output"]
        if source.meta[AMP].role is Role.PARAM and users:
            paths[cast.name] = _common(users)
        else:
            paths[cast.name] = paths[source.name]
    return paths


def _common(paths: list[str]) -> str:
    """The innermost module path containing every one of ``paths``."""
    parts = [p.split(".") if p else [] for p in paths]
    common: list[str] = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def module_types(gm: fx.GraphModule) -> dict[str, str]:
    """Module path -> class name, from the ``nn_module_stack`` tracing recorded and the
    model's own modules; containers (``nn.Module``) and the root are left out."""
    types: dict[str, str] = {}
    for node in gm.graph.nodes:
        for value in (node.meta.get("nn_module_stack") or {}).values():
            path, mtype = normalize_module_path(value[0]), value[1]
            if path != NO_MODULE:
                types.setdefault(path, mtype if isinstance(mtype, str) else mtype.__name__)
    for path, module in model_root(gm).named_modules():
        types.setdefault(path, type(module).__name__)
    names = {path: re.sub(r".*\.", "", name) for path, name in types.items() if path}
    return {path: name for path, name in names.items() if name != "Module"}


__all__ = ["NO_MODULE", "module_types", "node_modules"]
