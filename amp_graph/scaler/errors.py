"""The errors a misused :class:`~amp_graph.GradScaler` raises: torch's, with the fix added.

``torch.amp.GradScaler`` raises ``AssertionError`` for some misuses (``step()`` before any
``scale()``, ``update()`` before any check), ``RuntimeError`` or ``ValueError`` for others. For
each misuse amp_graph raises an exception that ``except`` clauses written for torch catch (an
instance of torch's class) and whose message starts with torch's message verbatim; it then says
how to fix the mistake. ``tests/test_scaler_torch_parity.py`` compares both scalers on every
misuse below.
"""

from __future__ import annotations


class ScalerStateError(RuntimeError, AssertionError):
    """A scaler method called out of order where torch asserts (also a RuntimeError)."""


class ScalerArgumentError(ValueError, AssertionError):
    """An invalid argument where torch asserts (also a ValueError)."""


# torch.amp.GradScaler's messages, verbatim.
NOT_SCALED = (
    "Attempted {funcname} but _scale is None.  This may indicate your script did not use "
    "scaler.scale(loss or outputs) earlier in the iteration."
)
UNSCALE_TWICE = "unscale_() has already been called on this optimizer since the last update()."
UNSCALE_AFTER_STEP = "unscale_() is being called after step()."
STEP_TWICE = "step() has already been called since the last update()."
CLOSURE = "Closure use is not currently supported if GradScaler is enabled."
FP16_GRADS = "Attempting to unscale FP16 gradients."
NO_CHECKS_FOR_OPTIMIZER = "No inf checks were recorded for this optimizer."
NO_CHECKS_BEFORE_UPDATE = "No inf checks were recorded prior to update."
NEW_SCALE = (
    "new_scale should be a float or a 1-element torch.cuda.FloatTensor or torch.FloatTensor "
    "with requires_grad=False."
)
EMPTY_STATE_DICT = (
    "The source state dict is empty, possibly because it was saved from a disabled instance "
    "of GradScaler."
)
PICKLE_MID_ITERATION = (
    "A GradScaler instance may only be pickled at the beginning of an iteration, or at the end "
    "after scaler.update()."
)
GROWTH_FACTOR = "The growth factor must be > 1.0."
BACKOFF_FACTOR = "The backoff factor must be < 1.0."
OUTPUTS = "outputs must be a Tensor or an iterable of Tensors"

# What amp_graph adds to them.
FIX_NOT_SCALED = "Call scaler.scale(loss).backward() before {funcname}()."
FIX_FP16_GRADS = (
    "The optimizer holds float16 parameters, so its updates would be rounded to float16: keep "
    "float32 parameters (autocast computes in float16 for you) or float32 master weights "
    "(amp_graph.Graph with policy 'O2'). A fused optimizer (fused=True) accepts float16 "
    "gradients, as with torch."
)
FIX_NO_CHECKS = (
    "No parameter of the optimizer has a .grad: call scaler.scale(loss).backward() first. A "
    "rank that holds no gradients of an optimizer can take the skip decision from the other "
    "ranks: pass GradScaler(process_group=...)."
)


def with_fix(message: str, fix: str) -> str:
    """torch's ``message`` followed by amp_graph's ``fix``."""
    return f"{message} {fix}"
