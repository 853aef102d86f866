"""Module hooks a capture cannot keep, refused before export.

torch.export records a module's forward hooks and pre-hooks as code of the graph, but
drops its backward hooks (``register_full_backward_hook``, ``register_full_backward_pre_hook``,
the legacy ``register_backward_hook``): the graph's backward never calls them, with no
error. A hook that silently stops firing is a silently wrong training run (gradient
clipping per module, a gradient monitor, a pruning mask), so the capture refuses it, naming
the module and the hooks that do fire.

>>> import torch.nn as nn
>>> refuse_backward_hooks(nn.Linear(2, 2))  # no backward hook: nothing to say
"""

from __future__ import annotations

import torch.nn as nn

from .capture_error import CaptureError


def _backward_hooked(model: nn.Module) -> list[str]:
    """The qualified names of the modules of ``model`` with a backward hook or pre-hook
    (``"(model)"`` for the root)."""
    return [
        name or "(model)"
        for name, module in model.named_modules()
        if module._backward_hooks or module._backward_pre_hooks
    ]


def refuse_backward_hooks(model: nn.Module) -> None:
    """Raise :class:`CaptureError` if a module of ``model`` has a backward hook, which the
    captured graph would never call; nothing otherwise."""
    hooked = _backward_hooked(model)
    if not hooked:
        return
    shown = ", ".join(hooked[:4]) + (f" and {len(hooked) - 4} more" if len(hooked) > 4 else "")
    raise CaptureError(
        f"amp_graph cannot capture {type(model).__name__}: module {shown} has a backward "
        "hook (register_full_backward_hook, register_full_backward_pre_hook or "
        "register_backward_hook), which torch.export drops, so the graph's backward would "
        "never call it. Remove it before compiling, and hook the module's parameters "
        "instead: param.register_hook(fn) or param.register_post_accumulate_grad_hook(fn) "
        "fire in the graph's backward, as the parameters are the model's own."
    )


__all__ = ["refuse_backward_hooks"]
