"""Pass fsdp_hooks: FSDP2's forward hooks as graph nodes at each unit's boundary.

The capture (:mod:`amp_graph.capture.fsdp_units`) records a model sharded with ``fully_shard``
with every unit unsharded and FSDP's forward hooks detached: the graph holds the model's
own ops on its full parameters. This pass puts the hooks back in, as calls that run them
where eager execution runs them::

    fsdp_unshard_blocks_0 = fsdp_pre_forward(blocks_0, x)      # all-gather; x passes through
    x_1 = fsdp_unshard_blocks_0[0]                              #   FSDP's post-backward hook
    weight = self.model.blocks[0].fc.weight                     # the unsharded parameter
    ...                                                         # the block's ops and casts
    fsdp_reshard_blocks_0 = fsdp_post_forward(blocks_0, y)      # reshard; y gets FSDP's
    y_1 = fsdp_reshard_blocks_0[0]                              #   pre-backward hook

A unit's region is every node whose ``nn_module_stack`` lies under the unit's module,
the ``get_attr`` reads of the unit's parameters, and every node computed from parameters
alone (casts of parameters) that reads one of them; the region of a unit holds those of
its sub-units. Guarantees: each region runs after its unit's pre-forward call (its
parameters are then the unsharded tensors) and before its post-forward call (after which,
with ``reshard_after_forward``, their storage is freed); the values a region reads from
outside are the pre-forward call's outputs (so gradients flow through FSDP's
``RegisterPostBackwardFunction``, whose backward reduce-scatters the unit's gradients), and
the values read after it are the post-forward call's outputs (which carry FSDP's
pre-backward hook, the backward all-gather); nested units nest as in eager; the root
unit's calls come first and last (its pre-forward does FSDP's lazy init). Every value is
computed as before: the hooks return their inputs, or (``MixedPrecisionPolicy`` with
``cast_forward_inputs`` or ``output_dtype``) the casts of them that the capture recorded
in their places, so the dtypes are the planned ones. A parameter of a unit read outside
its region, or regions of two sibling units that interleave, raise ``ValueError``.

Why the hooks as registered, called through the module's hook dicts
(:func:`fsdp_pre_forward`), and not FSDP's lower-level ``unshard()``/``reshard()``: the
hooks also do FSDP's lazy init, its prefetching, its autograd hooks and its training-state
bookkeeping, which ``reshard()`` alone would skip (backward would then find the state
wrong). Calling the callable FSDP registered runs whatever this torch version does in
eager, and needs only the hook handles (``FSDPState._pre_forward_hook_handle``).

Reads: ``gm.meta["amp_graph.fsdp_units"]``, ``meta["nn_module_stack"]``, ``meta["amp"]``
(parameters: ``role=PARAM``). Writes: the hook calls and their element picks, with
``meta["amp"]`` and ``meta["val"]``; ``meta["amp_graph.fsdp_unit"]`` on each parameter read of a
unit (:func:`hoist_parameter_casts` leaves their casts in place: outside the region the
parameter is a shard). Without FSDP units the graph is left as it is.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from .classify import module_stack
from .meta import AMP, FSDP_UNIT, FSDP_UNITS, MODEL_ROOT, VAL, AmpInfo, Role, model_root
from .result import PassResult


def fsdp_pre_forward(module: nn.Module, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """FSDP2's forward pre-hook of ``module`` on ``inputs`` (all-gather its parameters and
    register the post-backward hook on the inputs), as ``module(*inputs)`` would run it."""
    handle = module._get_fsdp_state()._pre_forward_hook_handle
    args, _ = module._forward_pre_hooks[handle.id](module, inputs, {})
    return tuple(args)


def fsdp_post_forward(module: nn.Module, *outputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """FSDP2's forward hook of ``module`` on ``outputs`` (reshard its parameters, register
    the pre-backward hook on the outputs), as ``module(...)`` would run it on return."""
    handle = module._get_fsdp_state()._post_forward_hook_handle
    return tuple(module._forward_hooks[handle.id](module, (), outputs))


def _within(path: str, unit: str) -> bool:
    """``path`` is ``unit`` or under it (``""`` is the root)."""
    return unit == "" or path == unit or path.startswith(unit + ".")


def _deepest(units: set[str], node: fx.Node) -> str | None:
    """The innermost of units that all lie on one chain; ValueError if two are siblings."""
    chain = sorted(units, key=lambda u: (u.count(".") + bool(u), u))
    for outer, inner in itertools.pairwise(chain):
        if not _within(inner, outer):
            raise ValueError(
                f"node {node.name!r} reads the parameters of two FSDP units, {outer!r} and "
                f"{inner!r}, neither inside the other: no place in the graph has both unsharded"
            )
    return chain[-1] if chain else None


def stack_unit(node: fx.Node, gm: fx.GraphModule, units: list[str]) -> str | None:
    """The innermost FSDP unit whose module the node ran in (by ``nn_module_stack``)."""
    paths, _ = module_stack(node, gm)
    inside = [p for p in paths if p in units]
    return inside[-1] if inside else None


def _homes(gm: fx.GraphModule, units: list[str]) -> tuple[dict[fx.Node, str], set[fx.Node]]:
    """Each node's unit (the innermost region it must run in), and the nodes computed from
    parameters alone that read a unit's parameter (they move next to their first user)."""
    root = model_root(gm)
    prefix = f"{gm.meta[MODEL_ROOT]}." if gm.meta.get(MODEL_ROOT) else ""
    parameters = {name for name, _ in root.named_parameters(remove_duplicate=False)}
    home: dict[fx.Node, str] = {}
    constant: dict[fx.Node, set[str]] = {}  # parameter-only nodes: the units they read
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            name = node.target[len(prefix) :] if node.target.startswith(prefix) else None
            owner = name.rpartition(".")[0] if name in parameters else None
            found = {u for u in units if owner is not None and _within(owner, u)}
            constant[node] = {_deepest(found, node)} if found else set()
            if found:
                node.meta[FSDP_UNIT] = home[node] = _deepest(found, node)
            continue
        if node.op in ("placeholder", "output"):
            continue
        reads = set().union(*(constant[a] for a in node.all_input_nodes if a in constant))
        if node.all_input_nodes and all(a in constant for a in node.all_input_nodes):
            constant[node] = reads
            if reads:
                home[node] = _deepest(reads, node)
            continue
        own = stack_unit(node, gm, units)
        unit = _deepest(reads | ({own} if own is not None else set()), node)
        if unit is not None:
            home[node] = unit
    for node in reversed(gm.graph.nodes):
        # a cast amp_graph inserted (no module of its own) runs where its readers run, as
        # autocast casts inside the module that reads the value
        amp = node.meta.get(AMP)
        if amp is None or amp.role is not Role.CAST or "nn_module_stack" in node.meta:
            continue
        readers = [home.get(u) for u in node.users]
        holding = [u for u in units if readers and all(_within(r or "?", u) for r in readers)]
        if holding and node not in constant:
            home[node] = max(holding, key=len)  # the innermost unit holding every reader
    return home, {n for n, r in constant.items() if r}


def _is_tensor(node: fx.Node) -> bool:
    """Whether the node's value is a tensor (inserted casts have a dtype, no fake value)."""
    if VAL in node.meta:
        return isinstance(node.meta[VAL], torch.Tensor)
    amp = node.meta.get(AMP)
    return amp is not None and isinstance(amp.out_dtype, torch.dtype)


def _move_to_first_use(gm: fx.GraphModule, movable: set[fx.Node]) -> None:
    """Each parameter read of a unit (and each cast of it) just before its first user, so
    that it runs inside the unit's region (export puts every parameter read at the top)."""
    placed: set[fx.Node] = set()

    def place(node: fx.Node, before: fx.Node) -> None:
        for arg in node.all_input_nodes:
            if arg in movable and arg not in placed:
                place(arg, before)
        placed.add(node)
        before.prepend(node)

    for node in list(gm.graph.nodes):
        if node in movable:
            continue
        for arg in node.all_input_nodes:
            if arg in movable and arg not in placed:
                place(arg, node)


def _value_info(node: fx.Node, detail: str) -> dict[str, Any]:
    """meta of an element pick standing for ``node``: its value and dtype, as a fixed node."""
    amp = node.meta.get(AMP)
    info = AmpInfo.fixed(
        Role.OTHER,
        "getitem",
        detail,
        module_path=amp.module_path if amp else "",
        out_dtype=amp.out_dtype if amp else None,
        exact=amp.exact if amp else False,
    )
    return {VAL: node.meta.get(VAL), AMP: info}


def _wrap_unit(gm: fx.GraphModule, unit: str, home: dict[fx.Node, str]) -> None:
    """The pre-forward call before the unit's region and the post-forward call after it."""
    nodes = list(gm.graph.nodes)
    members = [i for i, n in enumerate(nodes) if n in home and _within(home[n], unit)]
    if not members:
        return  # the unit's module is not called in this graph: FSDP runs no hooks either
    first, last = members[0], members[-1]
    span = nodes[first : last + 1]
    for node in span:
        other = home.get(node)
        if other is not None and not (_within(other, unit) or _within(unit, other)):
            raise ValueError(
                f"the regions of FSDP units {unit!r} and {other!r} interleave ({node.name}): "
                "amp_graph can only call FSDP's hooks around regions that nest as modules do"
            )
    inside = set(span)
    inputs: list[fx.Node] = []
    for node in span:
        for arg in node.all_input_nodes:
            if arg not in inside and arg.op != "get_attr" and _is_tensor(arg) and arg not in inputs:
                inputs.append(arg)
    outputs = [n for n in span if any(u not in inside for u in n.users)]
    outputs = [n for n in outputs if _is_tensor(n)]
    label = unit.replace(".", "_") or "root"
    root_attr = gm.meta.get(MODEL_ROOT) or ""
    target = ".".join(p for p in (root_attr, unit) if p)

    with gm.graph.inserting_before(span[0]):
        module = gm.graph.get_attr(target)  # read once: both calls take it
    module.meta[AMP] = AmpInfo.fixed(Role.OTHER, "FSDP unit", f"the FSDP2 module {unit!r}")
    home[module] = unit

    def call(fn: Any, anchor: fx.Node, values: list[fx.Node], name: str) -> fx.Node:
        with gm.graph.inserting_after(anchor):
            node = gm.graph.create_node("call_function", fn, (module, *values), name=name)
        node.meta[AMP] = AmpInfo.fixed(
            Role.OTHER, fn.__name__, f"FSDP2's {fn.__name__} hook of {unit or 'the root'!r}"
        )
        node.meta[VAL] = tuple(v.meta.get(VAL) for v in values)
        home[node] = unit
        return node

    pre = call(fsdp_pre_forward, module, inputs, f"fsdp_unshard_{label}")
    last_node = pre
    for i, value in enumerate(inputs):
        with gm.graph.inserting_after(last_node):
            pick = gm.graph.call_function(operator.getitem, (pre, i))
        pick.meta = _value_info(value, f"{value.name} through FSDP's pre-forward of {unit!r}")
        home[pick] = unit
        value.replace_all_uses_with(pick, delete_user_cb=lambda user: user in inside)
        last_node = pick
    post = call(fsdp_post_forward, span[-1], outputs, f"fsdp_reshard_{label}")
    last_node = post
    for i, value in enumerate(outputs):
        with gm.graph.inserting_after(last_node):
            pick = gm.graph.call_function(operator.getitem, (post, i))
        pick.meta = _value_info(value, f"{value.name} through FSDP's post-forward of {unit!r}")
        home[pick] = unit
        value.replace_all_uses_with(
            pick, delete_user_cb=lambda user: user not in inside and user is not post
        )
        last_node = pick


def fsdp_hooks(gm: fx.GraphModule) -> PassResult:
    """Call each FSDP2 unit's forward hooks around its region (see the module docstring);
    in place."""
    units: list[str] = list(gm.meta.get(FSDP_UNITS) or [])
    if not units:
        return PassResult(gm, modified=False, stats={"fsdp_units": 0})
    home, movable = _homes(gm, units)
    _move_to_first_use(gm, movable)
    for unit in reversed(units):  # innermost first: a region then holds its sub-units' calls
        _wrap_unit(gm, unit, home)
    gm.graph.lint()
    return PassResult(gm, modified=True, stats={"fsdp_units": len(units)})


__all__ = [
    "FSDP_UNIT",
    "FSDP_UNITS",
    "fsdp_hooks",
    "fsdp_post_forward",
    "fsdp_pre_forward",
    "stack_unit",
]
