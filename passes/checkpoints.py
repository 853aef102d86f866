"""outline_checkpoints: the model's activation checkpoints, recomputed in backward.

``torch.export`` traces through ``torch.utils.checkpoint.checkpoint(block, x,
use_reentrant=False)`` (and HF's ``gradient_checkpointing_enable()``): the block's ops are
recorded as plain forward code, and nothing would be recomputed. The capture marks them
(``meta["amp_graph.checkpoint_region"]``, one number per checkpoint call); this pass gives them back
their meaning: each region becomes a submodule ``checkpoint_<k>`` of the graph, called as
``torch.utils.checkpoint.checkpoint(self.checkpoint_<k>, *inputs, use_reentrant=False)``.
Autograd then saves only the region's inputs, and runs the region again in backward.

What a region holds: the nodes the capture marked; nodes between them that read the region
and are read only by it (the model's own casts, which run no kernel capture could mark);
the casts amp_graph inserted for the region alone (so the recomputation casts as the first
run did: the same dtypes, as torch.autocast recomputes under its own state); and the
element picks (``getitem``) of its tuples.
Parameters, buffers and graph inputs stay outside and are passed in: the submodule reads
nothing of the model itself, so the graph keeps sharing (and seeing replacements of) the
model's tensors. Dropout inside a region replays its mask (checkpoint's
``preserve_rng_state``).

Reads: ``meta["amp_graph.checkpoint_region"]``, ``meta["amp"]``. Writes: the submodules, one
``checkpoint`` call per region and a ``getitem`` per output it yields, each with
``meta["amp"]`` and ``meta["val"]``; the region's nodes move, with their meta, into the
submodule's graph. Guarantees: every value outside a region is computed as before; a region
that cannot be outlined (a value computed outside it between two of its nodes, which it
also reads) is left flat, with a warning that names it.
"""

from __future__ import annotations

import operator
import warnings

import torch
import torch.fx as fx
import torch.utils.checkpoint

from .meta import AMP, CHECKPOINT_REGION, VAL, AmpInfo, Role
from .result import PassResult

CHECKPOINT_PREFIX = "checkpoint_"
"""The name of each checkpointed block's submodule, before its number."""


def _region_nodes(gm: fx.GraphModule) -> dict[int, list[fx.Node]]:
    """Each region's nodes in graph order, with the casts made for them alone and the
    element picks of their values added."""
    region_of: dict[fx.Node, int] = {
        n: n.meta[CHECKPOINT_REGION] for n in gm.graph.nodes if CHECKPOINT_REGION in n.meta
    }
    changed = True
    while changed:  # what lies between a region's nodes, and the casts made for them alone
        changed = False
        for node in gm.graph.nodes:
            if node in region_of or node.op not in ("call_function", "call_method"):
                continue
            users = {region_of.get(u) for u in node.users}
            inputs = {region_of.get(a) for a in node.all_input_nodes}
            is_cast = AMP in node.meta and node.meta[AMP].role is Role.CAST
            region = None
            if len(users) == 1 and None not in users and (is_cast or users <= inputs):
                # read only by one region: a cast for it, or a node of it that computed
                # nothing capture could see (a no-op .to(), a model's cast)
                region = next(iter(users))
            elif node.target is operator.getitem and len(inputs) == 1 and None not in inputs:
                region = next(iter(inputs))
            if region is not None:
                region_of[node] = region
                changed = True
    regions: dict[int, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node in region_of:
            regions.setdefault(region_of[node], []).append(node)
    return regions


def _outline(gm: fx.GraphModule, number: int, nodes: list[fx.Node]) -> bool:
    inside = set(nodes)
    inputs: list[fx.Node] = []
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg not in inside and arg not in inputs:
                inputs.append(arg)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    # the call goes where the region's last input is ready; every outside use of its values
    # must come after it
    after = max([order[a] for a in inputs] + [order[nodes[0]] - 1])
    first_use = min(
        (order[u] for n in outputs for u in n.users if u not in inside), default=len(order)
    )
    if not outputs or after >= first_use:
        return False

    body = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for arg in inputs:
        env[arg] = body.placeholder(arg.name)
        env[arg].meta = dict(arg.meta)
    for node in nodes:
        env[node] = body.node_copy(node, lambda a: env[a])
    body.output(tuple(env[n] for n in outputs))
    name = f"{CHECKPOINT_PREFIX}{number}"
    while hasattr(gm, name):
        name = f"{name}_"
    gm.add_submodule(name, fx.GraphModule(gm, body, class_name="CheckpointRegion"))

    anchor = list(gm.graph.nodes)[after]
    with gm.graph.inserting_after(anchor):
        module = gm.graph.get_attr(name)
    with gm.graph.inserting_after(module):
        call = gm.graph.call_function(
            torch.utils.checkpoint.checkpoint, (module, *inputs), {"use_reentrant": False}
        )
    module.meta[AMP] = AmpInfo.fixed(Role.OTHER, "checkpoint region", "a submodule")
    detail = (
        f"torch.utils.checkpoint region {number} of the model: {len(nodes)} nodes, "
        "recomputed in backward"
    )
    call.meta[AMP] = AmpInfo.fixed(
        Role.OTHER,
        "checkpoint",
        detail,
        out_dtype=tuple(n.meta[AMP].out_dtype for n in outputs),
        exact=all(n.meta[AMP].exact for n in outputs),
    )
    call.meta[VAL] = tuple(n.meta.get(VAL) for n in outputs)
    last = call
    for index, node in enumerate(outputs):
        with gm.graph.inserting_after(last):
            pick = gm.graph.call_function(operator.getitem, (call, index))
        pick.meta = {k: v for k, v in node.meta.items() if k != CHECKPOINT_REGION}
        node.replace_all_uses_with(pick, delete_user_cb=lambda user: user not in inside)
        last = pick
    for node in reversed(nodes):
        gm.graph.erase_node(node)
    return True


def outline_checkpoints(gm: fx.GraphModule) -> PassResult:
    """Outline each marked checkpoint region into a submodule called through
    ``torch.utils.checkpoint.checkpoint`` (see the module docstring); in place."""
    outlined = 0
    for number, nodes in _region_nodes(gm).items():
        if _outline(gm, number, nodes):
            outlined += 1
        else:
            warnings.warn(
                f"amp_graph could not outline activation checkpoint region {number} "
                f"({nodes[0].name} ... {nodes[-1].name}): its activations are kept, not "
                "recomputed",
                stacklevel=2,
            )
    return PassResult(gm, modified=bool(outlined), stats={"checkpoint_regions": outlined})


__all__ = ["CHECKPOINT_REGION", "outline_checkpoints"]
