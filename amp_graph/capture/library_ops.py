"""Ops a user defined with ``torch.library.Library`` (or ``torch.library.define`` and
``impl``) and implemented in Python: found, and their kernels run on fake values.

Before ``torch.library.custom_op``, an op was defined in two steps: a schema
(``lib.define("proj(Tensor x, Tensor w) -> Tensor")``) and a kernel per dispatch key
(``lib.impl("proj", fn, "CPU")``, ``@torch.library.impl("ns::proj", "cuda")``); vLLM's
``direct_register_custom_op`` still does so. Under eager torch.autocast such a kernel runs
with autocast on, exactly as a custom op's body: its ``x @ w.t()`` computes in the low
dtype. amp_graph keeps these ops as it keeps custom ops (:mod:`.custom_ops`), so that their
kernels see autocast in every graph; this module says which ops they are and gives their
Python kernel for a device, which the capture runs on fake values to learn its dtypes.

Only ops whose schema was defined from Python (``torch.library``'s own record of them) in a
namespace that is not torch's or amp_graph's count, and only where a Python kernel serves
the inputs' device (its own key, ``CompositeExplicitAutograd``, or
``CompositeImplicitAutograd``, which export's pre-dispatch capture keeps as one op too): a
kernel written in C++ cannot be run on fake values.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

_TORCH_DIR = Path(torch.__file__).resolve().parent
_AMP_GRAPH_DIR = Path(__file__).resolve().parent.parent
# torch.library.define registers an op from torch/library.py whoever calls it: the namespaces
# torch itself defines that way (coor: torch 2.15's device queries), and the ones no user's
# op can have. tests/test_library_ops.py lists every op counted as a user's, on each torch
TORCH_NAMESPACES = frozenset({"aten", "prim", "prims", "debugprims", "pippy", "coor"})

# the dispatch key of a device's own kernel, by device type
_DEVICE_KEYS = {"cpu": "CPU", "cuda": "CUDA"}
_COMPOSITE_KEYS = ("CompositeExplicitAutograd", "CompositeImplicitAutograd")


def is_library_op(qualname: str) -> bool:
    """``qualname`` (``ns::op``) is an op a user defined with ``torch.library.Library`` or
    ``torch.library.define``, and not with ``torch.library.custom_op``: its schema was
    registered from Python, from a file outside torch and amp_graph."""
    from torch._library.custom_ops import OPDEFS

    if qualname not in torch.library._defs or qualname in OPDEFS:
        return False
    if qualname.split("::", 1)[0] in TORCH_NAMESPACES:
        return False
    where = _registered_from(qualname)
    if where is None:
        return False
    if where == _TORCH_DIR / "library.py":
        return True
    return not (where.is_relative_to(_TORCH_DIR) or where.is_relative_to(_AMP_GRAPH_DIR))


def _registered_from(qualname: str) -> Path | None:
    """The file the op's schema was registered from, as the dispatcher records it (the
    frame that made its ``Library``), else None."""
    try:
        dump = torch._C._dispatch_dump(qualname)
    except RuntimeError:  # a name the dispatcher does not parse (torch's fsdp spells one so)
        return None
    for line in dump.splitlines():
        if line.startswith("debug: registered at "):
            where = line.removeprefix("debug: registered at ").rsplit(":", 1)[0]
            return Path(where).resolve() if where.startswith("/") else Path(where)
    return None


def python_kernel_key(op: torch._ops.OpOverload, device_type: str) -> str | None:
    """The dispatch key of ``op``'s Python kernel for ``device_type`` (the device's own
    key first, then the composite ones), else None."""
    namespace, name = op._schema.name.split("::", 1)
    names = [name] if op._overloadname == "default" else []
    names.append(f"{name}.{op._overloadname}")
    keys = [k for k in (_DEVICE_KEYS.get(device_type), *_COMPOSITE_KEYS) if k]
    registered = torch.library._impls
    return next(
        (key for key in keys for n in names if f"{namespace}/{n}/{key}" in registered), None
    )


def library_kernel(op: torch._ops.OpOverload, device_type: str) -> Any:
    """The Python kernel that runs ``op`` on ``device_type``'s tensors, as a callable that
    takes the op's arguments (fake ones included), or None where the user's op has none.

    Called on fake tensors, it runs the user's Python below the op's fake: the ops it calls
    dispatch as usual, under the current autocast state."""
    if not is_library_op(op._schema.name) or python_kernel_key(op, device_type) is None:
        return None
    device_key = getattr(torch._C.DispatchKey, _DEVICE_KEYS.get(device_type, "CPU"))
    return functools.partial(op.redispatch, torch._C.DispatchKeySet(device_key))


def has_python_kernel(op: torch._ops.OpOverload) -> bool:
    """A user's ``torch.library`` op with a Python kernel for some device."""
    return is_library_op(op._schema.name) and any(
        python_kernel_key(op, device) is not None for device in _DEVICE_KEYS
    )


__all__ = [
    "TORCH_NAMESPACES",
    "has_python_kernel",
    "is_library_op",
    "library_kernel",
    "python_kernel_key",
]
