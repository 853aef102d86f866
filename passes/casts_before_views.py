"""Pass casts_before_views: a parameter or buffer read through layout views (or gathered)
and then cast is cast first, and viewed (or gathered) after.

Model code often reads a weight through a view before the op that needs it low: Falcon's
``x @ self.weight.T``, a mixture of experts' ``gate_up_proj.transpose(1, 2)``, SD3's
``pos_embed`` cropped by slices and reshaped. The plan casts the view, so the state's own
reader is the view, and :func:`passes.state_casts` (which stores low, for
:mod:`amp_graph.deploy`, only the state every reader casts) keeps such a weight in
float32. With the cast moved before the views, the weight's one reader is a cast and it is
stored low. The same holds for a gather: under O2 the cast placement (:mod:`place_casts`)
looks rows up in a float32 embedding table and casts the rows, instead of the table, which
in training saves casting the whole table every step; deployed, the table is stored low and
the lookup reads it, the same bits.

Reads: ``get_attr`` nodes, their users through the views of ``LAYOUT_VIEWS`` and the
gathers of ``GATHERS`` (the state as their first argument), and the conversions at the end
(:func:`passes.aten_casts.cast_dtype`, run after aten_casts; or the model's own
``x.to(dtype)``, which the plan may have made a cast, where it changes only the dtype).
Writes: one ``_to_copy`` of the state per such tensor read, the views then read it; the
conversions after the views are removed; the views' ``meta["val"]`` and
``meta["amp"].out_dtype`` (a gather's ``compute_dtype`` too) become the low dtype.
Guarantees: every reader receives the same values (a cast converts element by element, and
commutes with selecting, gathering and relaying out elements) with the same sizes and
strides (checked on the fake values before anything changes: a cast of a slice is
contiguous, a slice of a cast is not); only state read through these views and nothing
else, every read ending in a conversion to one dtype narrower than its own, is touched.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.node import map_arg

from .aten_casts import TO_COPY, cast_dtype
from .meta import AMP, VAL
from .result import PassResult
from .state_casts import state_attribute

aten = torch.ops.aten

# views of one tensor's elements (no overlapping strides, as expand would make); a cast
# commutes with each, and the readers' strides are checked on the fake values
LAYOUT_VIEWS = frozenset(
    {
        aten.t.default,
        aten.numpy_T.default,
        aten.transpose.int,
        aten.permute.default,
        aten.view.default,
        aten.reshape.default,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.squeeze.default,
        aten.slice.Tensor,
        aten.select.int,
        aten.narrow.default,
    }
)


# ops that only select elements of their first argument (no arithmetic): a cast commutes
# with each (the values gathered are the same bits either way)
GATHERS = frozenset(
    {
        aten.embedding.default,
        aten.index_select.default,
        aten.index.Tensor,
    }
)


_SELECTIONS = LAYOUT_VIEWS | GATHERS


def _selects(user: fx.Node, node: fx.Node) -> bool:
    """``user`` is a view or a gather of ``node``'s elements."""
    return (
        user.op == "call_function"
        and user.target in _SELECTIONS
        and user.args[0] is node
        and node not in user.args[1:]
    )


# the model's own conversions, as export spells ``x.to(dtype)`` and ``x.to(device)`` (which
# the plan may have made a cast)
_MODEL_CONVERSIONS = (aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default)


def _conversion_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype ``node`` converts its input to, where it changes nothing else (not the
    device, layout or memory format, and makes no copy it was asked for): an amp_graph
    cast, or the model's own conversion."""
    dtype = cast_dtype(node)
    if dtype is not None or node.op != "call_function" or node.target not in _MODEL_CONVERSIONS:
        return dtype
    kwargs = dict(node.kwargs)
    if node.target is aten.to.dtype and len(node.args) == 2:  # to(x, dtype), nothing after
        kwargs.setdefault("dtype", node.args[1])
    elif len(node.args) > 1:  # positional non_blocking, copy or memory_format: not read here
        return None
    source = node.args[0].meta.get(VAL) if isinstance(node.args[0], fx.Node) else None
    dtype = kwargs.pop("dtype", None)
    device = kwargs.pop("device", None)
    if kwargs.pop("layout", torch.strided) not in (None, torch.strided):
        return None
    if kwargs.pop("memory_format", None) not in (None, torch.preserve_format):
        return None
    kwargs.pop("non_blocking", None)
    if kwargs or not isinstance(dtype, torch.dtype) or not isinstance(source, torch.Tensor):
        return None  # ``copy=True``, or a fact unknown
    if device is not None and torch.device(device) != source.device:
        return None
    return dtype


def _views_and_casts(node: fx.Node) -> tuple[list[fx.Node], list[fx.Node]] | None:
    """The layout views under ``node`` and the casts ending them, or None if any reader is
    something else."""
    views: list[fx.Node] = []
    casts: list[fx.Node] = []
    for user in node.users:
        if _conversion_dtype(user) is not None and user.args[0] is node:
            casts.append(user)
        elif _selects(user, node):
            below = _views_and_casts(user)
            if below is None or not below[1]:
                return None
            views.append(user)
            views.extend(below[0])
            casts.extend(below[1])
        else:
            return None
    return views, casts


def _fake_of(node: fx.Node, value: torch.Tensor, views: list[fx.Node]) -> torch.Tensor:
    """The state's fake value: its node's, or one made in the mode of its views' values."""
    if isinstance(node.meta.get(VAL), torch.Tensor):
        return node.meta[VAL]
    mode = detect_fake_mode([view.meta.get(VAL) for view in views])
    return mode.from_tensor(value, static_shapes=True)


def _viewed(node: fx.Node, low: torch.Tensor, views: list[fx.Node]) -> dict[fx.Node, torch.Tensor]:
    """The views' values with the state cast first (views in graph order: parents first)."""
    vals = {node: low}
    for view in views:
        # a gather's indices: their example values
        rest = map_arg((view.args[1:], view.kwargs), lambda a: a.meta.get(VAL))
        vals[view] = view.target(vals[view.args[0]], *rest[0], **rest[1])
    return vals


def _cast_value(cast: fx.Node, dtype: torch.dtype) -> torch.Tensor | None:
    """What the cast gives now: its value, or its input's value cast (preserving strides)."""
    value = cast.meta.get(VAL)
    if isinstance(value, torch.Tensor):
        return value
    source = cast.args[0].meta.get(VAL)  # type: ignore[union-attr]
    return source.to(dtype) if isinstance(source, torch.Tensor) else None


def _same_layout(a: torch.Tensor, b: object) -> bool:
    return isinstance(b, torch.Tensor) and a.shape == b.shape and a.stride() == b.stride()


def casts_before_views(gm: fx.GraphModule) -> PassResult:
    """Cast state read through layout views and then cast, before the views."""
    moved = 0
    for node in list(gm.graph.nodes):
        if node.op != "get_attr":
            continue
        value = state_attribute(gm, node.target)  # type: ignore[arg-type]
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            continue
        if not value.is_contiguous():
            continue
        found = _views_and_casts(node)
        if found is None or not found[0]:
            continue
        views, casts = found
        dtypes = {_conversion_dtype(c) for c in casts}
        if len(dtypes) != 1:
            continue
        (dtype,) = dtypes
        if dtype is None or dtype.itemsize >= value.dtype.itemsize:
            continue
        low = _fake_of(node, value, views).to(dtype)
        vals = _viewed(node, low, views)
        if any(not _same_layout(vals[c.args[0]], _cast_value(c, dtype)) for c in casts):
            continue  # a reader would get other strides (a slice cast is contiguous)
        with gm.graph.inserting_after(node):
            cast = gm.graph.call_function(TO_COPY, (node,), {"dtype": dtype})
        cast.meta = dict(casts[0].meta)
        cast.meta[VAL] = low
        for user in list(node.users):
            if user is not cast:
                user.replace_input_with(node, cast)
        for view in views:
            view.meta[VAL] = vals[view]
            if AMP in view.meta:
                view.meta[AMP].out_dtype = dtype
                if view.target in GATHERS:  # it gathers the low copy now
                    view.meta[AMP].compute_dtype = dtype
        for old in casts:
            old.replace_all_uses_with(old.args[0])
            gm.graph.erase_node(old)
        moved += 1
    return PassResult(gm, bool(moved), {"state_casts_before_views": moved} if moved else {})


__all__ = ["GATHERS", "LAYOUT_VIEWS", "casts_before_views"]
