"""``amp_graph.replay`` of a compiled module's bundle (``"kind": "compile"``, written by
:mod:`amp_graph.monitoring.repro_compiled`): the step's forward and backward, bit for bit.

The model (a new instance, built as the training script builds it) gets the state of before
the step; the optimizer, where given, gets its state too (replay does not step it: the
recorded step was skipped). The model is compiled with the recorded policy and dtype and
captured, the RNG is set as the step found it, the call runs with the recorded arguments,
and backward starts from the gradient the loop's loss sent into each output (at the step's
loss scale). The output, every parameter's gradient and every buffer are compared with the
recorded ones; then :func:`amp_graph.numerics` reruns the same forward and backward beside a
float32 shadow and names the first non-finite node.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from amp_graph.frontends.compiler import compile as compile_model
from amp_graph.monitoring.repro import detached, set_rng
from amp_graph.policy.named_types import imported_type

from .bundle_files import bundle_policy, load_bundle_file
from .numerics import numerics as run_numerics


def replay_compiled(
    path: Path,
    meta: dict[str, Any],
    model: nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    numerics: bool,
    policy: Any = None,
) -> tuple[bool, list[str], Any, str]:
    """``(skipped again, mismatches, numerics report, note)`` of the bundle at ``path``."""
    if model is None:
        model = built_from(
            meta["model_class"],
            nn.Module,
            "the model",
            "model= (a new instance, built as the training script builds it)",
        )
    state = load_bundle_file(path / "state.pt")
    args, kwargs = load_bundle_file(path / "batch.pt")
    rng = load_bundle_file(path / "rng.pt")
    recorded = load_bundle_file(path / "step_result.pt")
    _load(model, optimizer, state)
    model.train(meta["training"])
    compiled = compile_model(model, policy or bundle_policy(path, meta), _dtype(meta["dtype"]))
    compiled.capture(*args, **kwargs)  # capturing draws random numbers: before the RNG is set
    _load(model, None, state)
    set_rng(rng)
    out = compiled(*args, **kwargs)
    outputs, grads = _seeded(out, recorded["output_grads"])
    torch.autograd.backward(outputs, grads)
    mismatches = [] if same_bits(detached(out), recorded["out"]) else ["output"]
    now = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for name in sorted(set(now) | set(recorded["grads"])) if meta["grads_kept"] else []:
        ours, theirs = now.get(name), recorded["grads"].get(name)
        if ours is None or theirs is None or not same_bits(ours, theirs):
            mismatches.append(name)
    for name, buffer in model.named_buffers():
        theirs = recorded["buffers"].get(name)
        if theirs is None or not same_bits(buffer, theirs):
            mismatches.append(f"buffer {name}")
    skipped = any(not bool(g.isfinite().all()) for g in now.values())
    notes = [meta["note"]] if meta.get("note") else []
    if torch.__version__ != meta["torch"]:
        notes.append(f"recorded with torch {meta['torch']}, replayed with {torch.__version__}")
    report = None
    if numerics:
        _load(model, None, state)
        set_rng(rng)
        report = run_numerics(
            compiled,
            *args,
            backward=True,
            loss_fn=lambda result: _loss_with_grads(result, recorded["output_grads"]),
            scale=1.0,  # the recorded output gradients carry the step's loss scale
            **kwargs,
        )
    for p in model.parameters():
        p.grad = None
    return skipped, mismatches, report, "; ".join(notes)


def same_bits(a: Any, b: Any) -> bool:
    """The same bits: dtype, shape, values, NaNs in the same places (NaN != NaN otherwise)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        a, b = a.detach().cpu(), b.detach().cpu()
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        return torch.equal(nan_a, nan_b) and torch.equal(
            a.masked_fill(nan_a, 0), b.masked_fill(nan_b, 0)
        )
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    leaves_a, spec_a = pytree.tree_flatten(a)
    leaves_b, spec_b = pytree.tree_flatten(b)
    if len(leaves_a) == 1 and leaves_a[0] is a:  # a leaf that is no tensor
        return a == b
    return spec_a == spec_b and all(
        same_bits(x, y) for x, y in zip(leaves_a, leaves_b, strict=True)
    )


def _load(model: nn.Module, optimizer: Any, state: dict[str, Any]) -> None:
    with torch.no_grad():
        model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def _seeded(out: Any, output_grads: list[Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The outputs the loop's loss reached, and the gradient it sent into each."""
    leaves = pytree.tree_leaves(out)
    pairs = [(o, g) for o, g in zip(leaves, output_grads, strict=False) if g is not None]
    if not pairs:
        raise ValueError(
            "the bundle holds no gradient of the step's outputs: its backward never reached "
            "the compiled module's outputs"
        )
    return [o for o, _ in pairs], [g for _, g in pairs]


def _loss_with_grads(out: Any, output_grads: list[Any]) -> torch.Tensor:
    """A scalar whose gradient into each output is the recorded one."""
    outputs, grads = _seeded(out, output_grads)
    return sum(
        (o.float() * g.to(o.device, torch.float32)).sum()
        for o, g in zip(outputs, grads, strict=True)
    )


def built_from(spec: str, base: type, what: str, instead: str) -> Any:
    """The recorded class ``module:qualname`` called with no arguments: how replay builds
    the Graph or model a bundle names. The class must be a subclass of ``base`` in a module
    this process has imported already (:func:`~amp_graph.policy.named_types.imported_type`:
    a bundle's names run no code); a TypeError saying to pass ``instead`` where it cannot."""
    try:
        cls = imported_type(spec, base, f"the class the bundle records for {what}")
    except ValueError as error:
        raise TypeError(f"replay cannot build {what}: {error}; pass {instead}") from None
    try:
        return cls()
    except Exception as error:
        raise TypeError(
            f"replay could not build {what} {spec} with no arguments ({type(error).__name__}:"
            f" {error}); pass {instead}"
        ) from None


__all__ = ["built_from", "replay_compiled", "same_bits"]
