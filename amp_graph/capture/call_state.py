"""The plain Python objects a kept call is given, as the user left them.

A custom autograd Function (or custom op) kept whole runs twice on fake values before it
ever runs for real: when the capture records it, and when the dtype planning runs the graph.
What it writes into the attributes of the plain objects among its arguments (bitsandbytes'
``state.CB = quantize(B)``, a cache filled on first use) would be fake tensors that the real
call then reads. torch.export restores the attributes of modules, not of other objects: the
capture undoes those writes (:func:`attributes_restored`) and refuses a fake value left
there by other code (:func:`fake_attribute`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree


@contextlib.contextmanager
def attributes_restored(tree: Any) -> Iterator[None]:
    """Undo, on exit, what the block writes into the attributes of the plain Python objects
    among ``tree``'s leaves (added, changed and deleted ones; shallowly: an object an
    attribute holds is not restored).

    A Function's forward that fills a cache on first use (bitsandbytes' ``state.CB =
    quantize(B)``) fills it with fake tensors when the capture runs it; the node then calls
    the Function with the same object at run time, which must find it as the user left it.
    torch.export restores the attributes of modules, not of other objects."""
    saved = [(leaf, dict(leaf.__dict__)) for leaf in _plain_objects(tree)]
    try:
        yield
    finally:
        for obj, before in saved:
            now = obj.__dict__
            for name in [n for n in now if n not in before]:
                del now[name]
            for name, value in before.items():
                if name not in now or now[name] is not value:
                    now[name] = value


def _plain_objects(tree: Any) -> list[Any]:
    """The leaves of ``tree`` that are Python objects with their own attribute dict: not
    tensors, classes, modules or values without attributes (numbers, strings, None)."""
    found: dict[int, Any] = {}
    for leaf in pytree.tree_leaves(tree):
        own = getattr(leaf, "__dict__", None)
        if isinstance(own, dict) and not isinstance(leaf, (torch.Tensor, type, torch.nn.Module)):
            found.setdefault(id(leaf), leaf)
    return list(found.values())


def fake_attribute(tree: Any) -> tuple[Any, str] | None:
    """(object, attribute) of a plain Python object among ``tree``'s leaves that holds a
    fake tensor, else None."""
    for obj in _plain_objects(tree):
        for name, value in obj.__dict__.items():
            if isinstance(value, FakeTensor):
                return obj, name
    return None


__all__ = ["attributes_restored", "fake_attribute"]
