"""A rewritten graph with kept calls, for ``torch.compile``: compiled around its Function calls.

A graph amp_graph captured keeps each custom autograd Function call as one node that runs the
Function's own ``apply`` under the capture's autocast state
(:class:`~amp_graph.capture.autograd_functions.FunctionCall`), and each custom op call the
same way. Handed whole to ``torch.compile``, dynamo would trace into those nodes: it cannot
trace the autocast switch around a call (``fullgraph`` then fails), and where it traces a
Function it does so with torch.amp's ``custom_fwd``/``custom_bwd`` states and dtype reads as
it saw them, not as torch.autocast runs them (amp_graph's backend refuses such Functions for
that reason).

:func:`compiled_around_calls` therefore compiles a copy of the graph in pieces:

* each custom op call becomes amp_graph's op that enters its autocast state
  (:func:`~amp_graph.capture.autocast_ops.custom_ops_as_autocast_ops`): opaque to the
  compiler, it stays inside a compiled piece;
* the graph is split at each remaining Function call: the pieces between them are compiled
  (``fullgraph``, as they hold aten ops only), and each Function call runs between them as
  in eager mode, its forward and backward the user's, under the autocast state of the
  capture. Autograd links the pieces, as it links the graphs of a model torch.compile splits
  at a graph break.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from amp_graph.capture.autocast_ops import custom_ops_as_autocast_ops
from amp_graph.capture.autograd_functions import function_calls, is_function_call
from amp_graph.passes.graph_copy import copy_graph_module

Compile = Callable[[fx.GraphModule], Callable[..., object]]


def has_kept_calls(gm: fx.GraphModule) -> bool:
    """``gm`` holds a kept Function or custom op call."""
    return bool(function_calls(gm))


def compiled_around_calls(gm: fx.GraphModule, compile_piece: Compile) -> torch.nn.Module:
    """``gm``'s computation with its pieces between kept Function calls compiled by
    ``compile_piece`` (see the module doc). ``gm`` itself is left as it is; the result
    shares its parameters and buffers.

    Guarantee: every kept call runs as ``gm`` runs it (a custom op's body, a Function's
    forward and backward under the capture's autocast state); everything else runs compiled.
    """
    copy = copy_graph_module(gm)
    custom_ops_as_autocast_ops(copy)
    if not function_calls(copy):
        return compile_piece(copy)
    split = split_module(copy, copy, _pieces(copy), keep_original_order=True)
    for name, piece in list(split.named_children()):
        if isinstance(piece, fx.GraphModule) and not function_calls(piece):
            setattr(split, name, compile_piece(piece))
    return split


def _pieces(gm: fx.GraphModule) -> Callable[[fx.Node], int]:
    """Node -> piece number: a new piece at each Function call, which is a piece of its own,
    in graph order (so no piece needs a later one's value)."""
    number, pieces = 0, {}
    for node in gm.graph.nodes:
        if is_function_call(node):
            number += 1
            pieces[node] = number
            number += 1
        else:
            pieces[node] = number
    return pieces.__getitem__


__all__ = ["compiled_around_calls", "has_kept_calls"]
