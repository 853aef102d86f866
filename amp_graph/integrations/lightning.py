"""A Lightning precision plugin: amp_graph's graph rewrite and scaler instead of torch.autocast.

``Trainer(precision="16-mixed")`` wraps every step in ``torch.autocast`` and uses torch's
GradScaler. :class:`AmpGraphPrecision` does the same jobs with amp_graph (the jobs of
Lightning's ``MixedPrecision`` plugin, ``lightning/pytorch/plugins/precision/amp.py``):

* **compile** (``connect``, after Lightning has moved the model to its device, so that
  :func:`amp_graph.compile` sees the device the model trains on): every direct child of the
  LightningModule that holds parameters (or the children named in ``modules``) is compiled
  with :func:`amp_graph.compile` and called through it (a container, ``nn.ModuleList`` or
  ``nn.ModuleDict``, is never called: the modules it holds are compiled instead), the way
  ``nn.Module.compile()`` installs torch.compile: the child keeps its class, attributes and
  ``state_dict`` keys, so checkpoints load with or without the plugin. The LightningModule
  itself is not compiled (its ``training_step`` is Python that Lightning calls; its
  ``forward`` need not be the training path). A child's parameter that ``training_step``
  reads outside the child (a tied output embedding, ``h @ self.emb.weight.T``) computes in
  float32 there, unannounced.
* **no torch.autocast** (``forward_context`` is a null context): the compiled graphs already
  compute each op at the dtype the policy gives it. The children return their low outputs in
  float32 (``output_dtype``, by default), so that the loss ``training_step`` computes on
  them runs in float32, as it does under ``MixedPrecision``'s autocast.
* **float16**: :class:`amp_graph.GradScaler` scales the loss in ``pre_backward``; in
  ``optimizer_step`` the closure runs, the gradients are unscaled (so clipping sees true
  gradients), then ``step`` (skipped on inf/nan) and ``update``, as ``MixedPrecision`` does.
* **bfloat16**: no scale, but steps whose gradients hold inf/nan are still skipped
  (:class:`amp_graph.scaler.NonFiniteGuard`), after clipping.
* **state**: the scaler's (or the guard's) state is the plugin's ``state_dict()``, which
  Lightning writes into every checkpoint and restores on ``fit(ckpt_path=...)``.

Lightning is an optional dependency: ``pip install lightning`` (or ``amp_graph[lightning]``).
``import amp_graph`` never imports it.

Example::

    import lightning, torch
    from amp_graph.integrations.lightning import AmpGraphPrecision

    trainer = lightning.Trainer(plugins=[AmpGraphPrecision(dtype=torch.float16)])
    trainer.fit(lightning_module, dataloader)
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

try:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.utilities import GradClipAlgorithmType
    from lightning.pytorch.utilities.exceptions import MisconfigurationException
except ImportError as error:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "amp_graph.integrations.lightning needs Lightning, which is not installed: "
        "pip install lightning  (or: pip install 'amp_graph[lightning]')"
    ) from error

from amp_graph.frontends.compile_modes import check_mode
from amp_graph.frontends.compiler import CompiledModule
from amp_graph.frontends.compiler import compile as amp_compile
from amp_graph.monitoring import Monitor, monitor
from amp_graph.policy import Policy, check_output_dtype
from amp_graph.scaler import GradScaler, NonFiniteGuard

__all__ = ["AmpGraphPrecision", "compile_in_place"]

_PRECISION = {torch.float16: "16-mixed", torch.bfloat16: "bf16-mixed"}


def compile_in_place(
    module: nn.Module,
    policy: Policy | str,
    dtype: torch.dtype,
    mode: str | None = None,
    output_dtype: torch.dtype | None = None,
) -> None:
    """Make ``module(...)`` run through ``amp_graph.compile(module, policy, dtype, mode=mode,
    output_dtype=output_dtype)``.

    What ``nn.Module.compile()`` does for torch.compile: the compiled callable is installed as
    the module's ``_compiled_call_impl``, so the module keeps its class, attributes and
    ``state_dict`` keys (a :class:`~amp_graph.CompiledModule` in its place would add
    ``_orig_mod.`` to every key). Bad policies and dtypes are refused here, not at the first
    call. As with ``nn.Module.compile()``, a copy of the module (``copy.deepcopy``, pickling)
    is not compiled: torch's ``Module.__getstate__`` drops ``_compiled_call_impl``, so the copy
    runs its own weights through its own forward.
    """
    call = _CompiledCall(module, policy, dtype, mode, output_dtype)
    object.__setattr__(module, "_compiled_call_impl", call)


class _CompiledCall:
    """A module's ``_compiled_call_impl``: calls go to its :class:`~amp_graph.CompiledModule`,
    except the call the capture itself makes (torch.export calls the module), which runs the
    module's own forward."""

    def __init__(
        self,
        module: nn.Module,
        policy: Policy | str,
        dtype: torch.dtype,
        mode: str | None,
        output_dtype: torch.dtype | None,
    ) -> None:
        self.module = module
        self.compiled = amp_compile(
            module, policy=policy, dtype=dtype, mode=mode, output_dtype=output_dtype
        )
        self.running = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.running:  # the capture tracing the module: its own forward
            return self.module._call_impl(*args, **kwargs)
        self.running = True
        try:
            return self.compiled(*args, **kwargs)
        finally:
            self.running = False


def _is_container(module: nn.Module) -> bool:
    """A module that is never called, only holds others (``nn.ModuleList``, ``nn.ModuleDict``,
    any module without a ``forward`` of its own): compiling it would compile nothing."""
    return type(module).forward is nn.Module.forward


def _called_modules(
    children: Mapping[str, nn.Module], explicit: bool, prefix: str = ""
) -> Iterator[tuple[str, nn.Module]]:
    """The modules to compile among ``children``, by dotted path: each child that holds
    parameters (every one if ``explicit``: named in ``modules``), and in place of a
    container, the modules it holds, found the same way."""
    for name, child in children.items():
        path = f"{prefix}{name}"
        if _is_container(child):
            yield from _called_modules(dict(child.named_children()), explicit, f"{path}.")
        elif explicit or any(True for _ in child.parameters()):
            yield path, child


def _uncompiled_parameters(module: nn.Module) -> list[str]:
    """The parameters no compiled forward reads: ``module``'s own, and those its containers
    hold themselves (``nn.ParameterList``), by dotted path."""
    names = [name for name, _ in module.named_parameters(recurse=False)]
    for name, child in module.named_children():
        if _is_container(child):
            names += [f"{name}.{inner}" for inner in _uncompiled_parameters(child)]
    return names


def _compiled_module_of(module: nn.Module) -> nn.Module:
    """The :class:`~amp_graph.CompiledModule` a child runs through (itself if it is one)."""
    call = module._compiled_call_impl
    return module if call is None else call.compiled


def _is_compiled(module: nn.Module, name: str) -> bool:
    """The child already runs through amp_graph (compiled by this plugin or by the user).
    A child compiled by ``nn.Module.compile()`` runs through torch.compile at a backend the
    plugin cannot see, without the torch.autocast it turns off: refused."""
    if isinstance(module, CompiledModule) or isinstance(module._compiled_call_impl, _CompiledCall):
        return True
    if module._compiled_call_impl is not None:
        raise ValueError(
            f"AmpGraphPrecision: child {name!r} ({type(module).__name__}) was compiled with "
            "nn.Module.compile() (torch.compile). The plugin runs no torch.autocast, so it "
            "would compute in float32 unless its backend is amp_graph's. Drop the .compile() "
            "and let the plugin compile the child, or leave it out with "
            "AmpGraphPrecision(modules=[...]) if you compiled it with "
            "backend=amp_graph.backend(...)."
        )
    return False


class AmpGraphPrecision(Precision):
    """Lightning ``Precision`` plugin: amp_graph-compiled modules, no torch.autocast, and
    amp_graph's loss scaler (float16) or inf/nan step skipping (bfloat16).

    Args:
        policy: the :func:`amp_graph.compile` policy (a preset name or a ``Policy``).
        dtype: ``torch.float16`` (with a loss scaler) or ``torch.bfloat16`` (without).
        scaler: the :class:`amp_graph.GradScaler` for float16 (default: ``GradScaler()``, the
            device taken from the first loss). Refused with bfloat16, as by ``MixedPrecision``.
        modules: names of the LightningModule's direct children to compile. Default: every
            child that holds parameters (so metrics and parameterless losses are left alone).
            A container (``nn.ModuleList``, ``nn.ModuleDict``) stands for the modules it holds.
        mode: what runs the compiled graphs, :func:`amp_graph.compile`'s ``mode``
            (``"eager"``, ``"default"`` for inductor, ``"reduce-overhead"``, ...; ``None``:
            by the device the model trains on, as in ``compile``). Checked here by name, and
            against the device when Lightning connects the model.
        monitor: options of :func:`amp_graph.monitor` (``{"every": 100, "log_dir": ...}``)
            to watch every compiled child's numerics while training; the plugin's scaler is
            given, and with several children each writes under ``log_dir/<child>``. The
            monitors are ``plugin.monitors``, by child name. A training step (one call with
            gradients) is a step; validation runs the graphs as they are.
        output_dtype: what the children return their low-precision outputs in
            (:func:`amp_graph.compile`'s ``output_dtype``): ``torch.float32`` (the default),
            so that ``training_step``'s loss on them computes in float32, as under
            ``MixedPrecision``'s torch.autocast (the same loss, bit for bit, under
            ``policy="autocast"``); None returns them as computed (a loss on them then
            computes in the low dtype unless ``training_step`` casts).

    Raises:
        ValueError: a dtype other than float16/bfloat16, an unknown ``mode``, an unknown
            name in ``modules``, a child compiled by ``nn.Module.compile()`` (it would run
            in float32), or an ``output_dtype`` other than float32 or None.
        MisconfigurationException: a scaler with bfloat16; the LBFGS optimizer.
    """

    def __init__(
        self,
        policy: Policy | str = "O1",
        dtype: torch.dtype = torch.float16,
        scaler: GradScaler | None = None,
        *,
        modules: Sequence[str] | None = None,
        mode: str | None = None,
        monitor: Mapping[str, Any] | None = None,
        output_dtype: torch.dtype | None = torch.float32,
    ) -> None:
        if dtype not in _PRECISION:
            raise ValueError(
                f"AmpGraphPrecision(dtype={dtype}): dtype must be torch.float16 or "
                "torch.bfloat16 (float32 training needs no precision plugin)"
            )
        if scaler is not None and dtype is torch.bfloat16:
            raise MisconfigurationException(
                f"AmpGraphPrecision(dtype=torch.bfloat16) does not scale the loss, found {scaler}; "
                "inf/nan steps are skipped without a scaler"
            )
        check_mode(mode, "AmpGraphPrecision(mode=...)")
        check_output_dtype(output_dtype, "AmpGraphPrecision(output_dtype=...)")
        self.output_dtype = output_dtype
        self.policy = policy
        self.dtype = dtype
        self.mode = mode
        self.precision = _PRECISION[dtype]  # type: ignore[assignment]
        self.modules = None if modules is None else list(modules)
        if monitor is not None and not isinstance(monitor, Mapping):
            raise TypeError(
                "AmpGraphPrecision(monitor=...) takes amp_graph.monitor's options as a dict, "
                f"e.g. {{'every': 100, 'log_dir': 'runs/amp'}}; got {monitor!r}"
            )
        self.monitor_options = None if monitor is None else dict(monitor)
        self.monitors: dict[str, Monitor] = {}
        self._warned_own_parameters = False
        self.scaler: GradScaler | None = None
        self.guard: NonFiniteGuard | None = None
        if dtype is torch.float16:
            self.scaler = scaler if scaler is not None else GradScaler()
        else:
            self.guard = NonFiniteGuard()

    # ---- the model -----------------------------------------------------------------------

    def connect(
        self, model: nn.Module, optimizers: list[torch.optim.Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[torch.optim.Optimizer], list[Any]]:
        """Compile the LightningModule's children (:meth:`compile_modules`). Lightning calls
        this after moving the model to its device and wrapping it (DDP), not
        ``convert_module``, which runs before the move: the compiled graphs are for the
        device the model trains on. Returns its arguments."""
        lightning_module = model
        while not isinstance(lightning_module, pl.LightningModule):
            inner = getattr(lightning_module, "module", None)
            if not isinstance(inner, nn.Module):
                raise TypeError(
                    f"AmpGraphPrecision found no LightningModule in {type(model).__name__}"
                )
            lightning_module = inner
        self.compile_modules(lightning_module)
        return model, optimizers, lr_schedulers

    def compile_modules(self, module: nn.Module) -> None:
        """Compile ``module``'s children in place (see the module doc); for a container
        child (no ``forward`` of its own: ``nn.ModuleList``, ``nn.ModuleDict``), the modules
        it holds, recursively, by dotted path (``blocks.0``; the keys of ``monitors``).
        Children already compiled by amp_graph are left as they are; one compiled by
        ``nn.Module.compile()`` is refused. Parameters the module, or a container, holds
        itself get a WARNING (float32)."""
        children = dict(module.named_children())
        if self.modules is not None:
            unknown = [n for n in self.modules if n not in children]
            if unknown:
                raise ValueError(
                    f"AmpGraphPrecision(modules=...): {type(module).__name__} has no child "
                    f"{unknown[0]!r}; its children are {sorted(children)}"
                )
            children = {n: children[n] for n in self.modules}
        targets = dict(_called_modules(children, explicit=self.modules is not None))
        self._warn_own_parameters(module)
        for name, child in targets.items():
            if not _is_compiled(child, name):
                compile_in_place(child, self.policy, self.dtype, self.mode, self.output_dtype)
            if self.monitor_options is not None and name not in self.monitors:
                options = dict(self.monitor_options)
                if options.get("log_dir") is not None and len(targets) > 1:
                    options["log_dir"] = Path(options["log_dir"]) / name
                target = _compiled_module_of(child)
                self.monitors[name] = monitor(target, scaler=self.scaler, **options)

    def _warn_own_parameters(self, module: nn.Module) -> None:
        own = _uncompiled_parameters(module)
        if own and not self._warned_own_parameters:
            self._warned_own_parameters = True
            warnings.warn(
                f"AmpGraphPrecision: {type(module).__name__} holds parameters of its own "
                f"({', '.join(own[:4])}{', ...' if len(own) > 4 else ''}). The plugin compiles "
                "its children and runs no torch.autocast, so what training_step computes "
                "with these outside the children runs in float32. Move them into a child "
                "module to have them compiled too.",
                stacklevel=3,
            )

    def forward_context(self) -> contextlib.AbstractContextManager:
        """No torch.autocast: the compiled graphs carry their casts."""
        return contextlib.nullcontext()

    # ---- backward and step ---------------------------------------------------------------

    def pre_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:  # type: ignore[override]
        """Scale the loss (float16), then Lightning's ``on_before_backward`` hooks."""
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: torch.optim.Optimizer,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Run the closure (forward, backward), unscale (float16), clip through Lightning's
        hooks, then step unless a gradient is inf/nan; float16 then updates the scale."""
        if isinstance(optimizer, torch.optim.LBFGS):
            raise MisconfigurationException(
                "AmpGraphPrecision and the LBFGS optimizer are not compatible: LBFGS calls the "
                "closure several times per step, and a skipped step cannot be undone inside it"
            )
        closure_result = closure()
        # Automatic optimization whose training_step returned None: no backward ran.
        skip = closure_result is None and model.automatic_optimization
        if self.scaler is not None and not skip and not _handles_unscaling(optimizer):
            self.scaler.unscale_(optimizer)  # before clipping in _after_closure
        self._after_closure(model, optimizer)
        if skip:
            return closure_result
        if self.scaler is not None:
            output = self.scaler.step(optimizer, **kwargs)
            self.scaler.update()
            return output
        assert self.guard is not None
        self.guard.check(optimizer)
        output = self.guard.step(optimizer, **kwargs)
        self.guard.end_step()
        return output

    # ---- clipping ------------------------------------------------------------------------

    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip the (already unscaled) gradients; refused for optimizers that unscale inside
        their own step (fused ones), whose gradients are still scaled here."""
        if clip_val > 0 and self.scaler is not None and _handles_unscaling(optimizer):
            raise RuntimeError(
                f"{type(optimizer).__qualname__} unscales gradients inside its step (fused=True), "
                "so they are still scaled when Lightning clips them: use a non-fused optimizer "
                "to clip with dtype=torch.float16"
            )
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale the optimizer's gradients now (float16; a no-op for bfloat16)."""
        if self.scaler is None:
            return
        if _handles_unscaling(optimizer):
            raise NotImplementedError(
                f"{type(optimizer).__qualname__} unscales gradients inside its step (fused=True)"
            )
        self.scaler.unscale_(optimizer)

    # ---- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (float16) or the guard's skip count (bfloat16)."""
        if self.scaler is not None:
            return self.scaler.state_dict()
        assert self.guard is not None
        return self.guard.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if self.scaler is not None:
            self.scaler.load_state_dict(state_dict)
        elif self.guard is not None and state_dict:
            self.guard.load_state_dict(state_dict)


def _handles_unscaling(optimizer: Any) -> bool:
    """Whether the optimizer takes ``grad_scale``/``found_inf`` and unscales in its step."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))
