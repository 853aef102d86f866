"""amp_graph.integrations.lightning.AmpGraphPrecision in a real lightning.Trainer (CPU), checked
against a hand-written amp_graph + GradScaler loop on the same data."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402

import amp_graph  # noqa: E402
from amp_graph.integrations.lightning import AmpGraphPrecision  # noqa: E402

BATCH, STEPS_PER_EPOCH, INF_STEP, CLIP = 4, 4, 1, 0.5


class Regressor(pl.LightningModule):
    """A tiny MLP; records, per training step, the loss and whether autocast was on."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
        self.losses: list[float] = []
        self.autocast: list[bool] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        self.autocast.append(torch.is_autocast_enabled("cpu"))
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Recorder(pl.Callback):
    """Parameters, scale and gradient norms (before and after clipping) after every step."""

    def __init__(self) -> None:
        self.params: list[list[torch.Tensor]] = []
        self.scales: list[float] = []
        self.norm_before_clip: list[float] = []
        self.norm_after_clip: list[float] = []

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        self.norm_before_clip.append(_grad_norm(pl_module))

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any
    ) -> None:
        self.norm_after_clip.append(_grad_norm(pl_module))  # grads live until the next step
        self.params.append([p.detach().clone() for p in pl_module.parameters()])
        scaler = trainer.precision_plugin.scaler
        self.scales.append(scaler.get_scale() if scaler is not None else 1.0)


def _same(a: Iterable[torch.Tensor], b: Iterable[torch.Tensor]) -> bool:
    """Whether two parameter lists are bit-equal."""
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _grad_norm(module: nn.Module) -> float:
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()


def _data(inf: bool) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH * STEPS_PER_EPOCH, 4, generator=gen)
    y = x.sum(1, keepdim=True).sin()
    if inf:
        x[INF_STEP * BATCH, 0] = float("inf")  # one batch overflows in every epoch
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


def _model(seed: int = 0) -> Regressor:
    torch.manual_seed(seed)
    return Regressor()


def _fit(
    model: Regressor,
    plugin: AmpGraphPrecision,
    epochs: int,
    inf: bool = True,
    ckpt_path: str | None = None,
    clip: float | None = CLIP,
) -> tuple[pl.Trainer, Recorder]:
    recorder = Recorder()
    trainer = _fit_quietly(
        model,
        _data(inf),
        ckpt_path,
        max_epochs=epochs,
        plugins=[plugin],
        callbacks=[recorder],
        gradient_clip_val=clip,
    )
    return trainer, recorder


def _fit_quietly(
    model: pl.LightningModule, data: DataLoader, ckpt_path: str | None, **options: Any
) -> pl.Trainer:
    """A CPU Trainer without logging, checkpoints or bars (``options`` besides), fitted
    with the small-data warnings silenced."""
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", ".*no `val_dataloader`.*")
        trainer.fit(model, data, ckpt_path=ckpt_path)
    return trainer


def _fp16_plugin() -> AmpGraphPrecision:
    scaler = amp_graph.GradScaler(init_scale=2.0**8, growth_interval=3)
    return AmpGraphPrecision(policy="O1", dtype=torch.float16, scaler=scaler)


def test_fp16_skips_the_inf_step_like_a_hand_written_loop() -> None:
    model = _model()
    reference = copy.deepcopy(model.net)
    trainer, rec = _fit(model, _fp16_plugin(), epochs=1)

    # The plugin compiled the network in place: same class, same state_dict keys, no autocast.
    assert model.net._compiled_call_impl is not None
    assert list(model.net.state_dict()) == list(reference.state_dict())
    assert model.autocast == [False] * STEPS_PER_EPOCH
    # The inf step is skipped (parameters unchanged, scale halved); the others are taken.
    assert _same(rec.params[INF_STEP - 1], rec.params[INF_STEP])
    assert rec.scales[INF_STEP] == rec.scales[INF_STEP - 1] / 2
    for before, after in zip(rec.params[INF_STEP:-1], rec.params[INF_STEP + 1 :], strict=True):
        assert not _same(before, after)
    assert trainer.precision_plugin.scaler.skipped_steps == 1
    # Clipping saw unscaled gradients: their norm is that of the loss, not of loss * scale.
    assert max(rec.norm_after_clip[i] for i in (0, 2, 3)) <= CLIP * (1 + 1e-5)
    assert 0 < rec.norm_before_clip[0] < 100, rec.norm_before_clip  # scale is 256

    # The same steps by hand: amp_graph.compile + GradScaler + clip on unscaled gradients.
    net = amp_graph.compile(reference, policy="O1", dtype=torch.float16)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    scaler = amp_graph.GradScaler(init_scale=2.0**8, growth_interval=3)
    for x, y in _data(inf=True):
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(net(x).float(), y)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        scaler.step(opt)
        scaler.update()
    assert _same(model.net.parameters(), reference.parameters())
    assert trainer.precision_plugin.scaler.get_scale() == scaler.get_scale()


def test_fp16_resume_from_checkpoint_is_bit_exact(tmp_path: Path) -> None:
    whole, _ = _fit(_model(), _fp16_plugin(), epochs=3)

    first, _ = _fit(_model(), _fp16_plugin(), epochs=1)
    path = str(tmp_path / "epoch1.ckpt")
    first.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["AmpGraphPrecision"]
    assert saved["scale"] == first.precision_plugin.scaler.get_scale()
    assert saved["_growth_tracker"] == 2  # two finite steps since the backoff: restored below

    resumed_model = _model(seed=1)  # other weights: the checkpoint must bring them back
    resumed, _ = _fit(resumed_model, _fp16_plugin(), epochs=3, ckpt_path=path)

    assert _same(resumed_model.parameters(), whole.lightning_module.parameters())
    assert resumed.precision_plugin.state_dict() == whole.precision_plugin.state_dict()
    assert resumed.precision_plugin.scaler.get_scale() == whole.precision_plugin.scaler.get_scale()


def test_bf16_no_autocast_loss_falls_skips_inf_and_clips() -> None:
    model, epochs = _model(), 5
    plugin = AmpGraphPrecision(policy="O1", dtype=torch.bfloat16)
    _, rec = _fit(model, plugin, epochs=epochs)

    assert model.autocast == [False] * epochs * STEPS_PER_EPOCH
    # Loss falls on every finite batch from the first epoch to the last.
    first, last = model.losses[:STEPS_PER_EPOCH], model.losses[-STEPS_PER_EPOCH:]
    for i in range(STEPS_PER_EPOCH):
        if i != INF_STEP:
            assert last[i] < 0.8 * first[i], model.losses
    # Each epoch's inf batch is skipped: parameters unchanged across it.
    assert plugin.guard is not None and plugin.guard.skipped_steps == epochs
    for step in range(INF_STEP, epochs * STEPS_PER_EPOCH, STEPS_PER_EPOCH):
        assert _same(rec.params[step - 1], rec.params[step])
    assert max(rec.norm_before_clip) > CLIP  # clipping had work to do ...
    finite_steps = [i for i in range(len(rec.params)) if i % STEPS_PER_EPOCH != INF_STEP]
    assert max(rec.norm_after_clip[i] for i in finite_steps) <= CLIP * (1 + 1e-5)  # ... and did
    assert plugin.state_dict() == {"skipped_steps": epochs}


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match=r"float16 or torch\.bfloat16"):
        AmpGraphPrecision(dtype=torch.float32)
    with pytest.raises(MisconfigurationException, match="does not scale the loss"):
        AmpGraphPrecision(dtype=torch.bfloat16, scaler=amp_graph.GradScaler())
    with pytest.raises(ValueError, match="no child 'nett'"):
        AmpGraphPrecision(modules=["nett"]).compile_modules(_model())


def test_the_mode_is_amp_graph_compiles_and_checked_early() -> None:
    """``mode=`` reaches amp_graph.compile: "default" runs the children's graphs through
    inductor, with the eager graph's results; a misspelt mode is refused when the plugin is
    made, a CUDA-graph mode when it meets a CPU model (not at the first step)."""
    with pytest.raises(ValueError, match=r"AmpGraphPrecision\(mode=\.\.\.\).*'defualt'.*'default'"):
        AmpGraphPrecision(mode="defualt")
    with pytest.raises(amp_graph.CudaGraphError, match="'reduce-overhead' is for CUDA graphs"):
        AmpGraphPrecision(dtype=torch.bfloat16, mode="reduce-overhead").compile_modules(_model())
    x = torch.randn(BATCH, 4)
    outputs = {}
    for mode in ("eager", "default"):
        model = _model()
        # outputs as computed: the bf16 output shows the graph ran low
        plugin = AmpGraphPrecision(dtype=torch.bfloat16, mode=mode, output_dtype=None)
        plugin.compile_modules(model)
        compiled = model.net._compiled_call_impl.compiled
        assert compiled.mode.name == mode
        outputs[mode] = model.net(x)
        outputs[mode].float().sum().backward()
        assert (compiled._inductor is None) == (mode == "eager")
        assert mode == "eager" or len(compiled._inductor) == 1  # the graph went to inductor
        outputs[mode] = (outputs[mode].detach(), model.net[0].weight.grad)
    assert outputs["default"][0].dtype == torch.bfloat16
    torch.testing.assert_close(outputs["default"][0], outputs["eager"][0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(outputs["default"][1], outputs["eager"][1], atol=2e-2, rtol=2e-2)


def test_a_child_compiled_by_torch_compile_is_refused() -> None:
    """nn.Module.compile() runs the child through torch.compile with no autocast under the
    plugin: float32, which the plugin used to take for compiled and leave without a word."""
    model = _model()
    model.net.compile()
    with pytest.raises(ValueError, match=r"child 'net' \(Sequential\).*nn\.Module\.compile"):
        AmpGraphPrecision(dtype=torch.bfloat16).compile_modules(model)
    # compiled by amp_graph (the plugin's own, or amp_graph's wrapper): left as it is
    model = _model()
    plugin = AmpGraphPrecision(dtype=torch.bfloat16)
    plugin.compile_modules(model)
    call = model.net._compiled_call_impl
    plugin.compile_modules(model)
    assert model.net._compiled_call_impl is call


class WithOwnScale(Regressor):
    """A parameter of the LightningModule itself, used in training_step."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))


def test_parameters_of_the_lightning_module_itself_are_named_at_warning() -> None:
    with pytest.warns(UserWarning, match=r"WithOwnScale holds parameters of its own \(scale\)"):
        AmpGraphPrecision(dtype=torch.bfloat16).compile_modules(WithOwnScale())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AmpGraphPrecision(dtype=torch.bfloat16).compile_modules(_model())


def test_lightning_stays_optional() -> None:
    code = (
        "import sys, amp_graph; assert 'lightning' not in sys.modules, 'imported lightning'\n"
        "sys.modules['lightning'] = None\n"
        "try:\n"
        "    import amp_graph.integrations.lightning\n"
        "except ImportError as e:\n"
        "    assert 'pip install lightning' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('no ImportError')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_copy_of_a_compiled_child_runs_its_own_weights() -> None:
    model = _model()
    AmpGraphPrecision(dtype=torch.float16).compile_modules(model)
    x = torch.randn(2, 4)
    model.net(x)  # captured
    for clone in (copy.deepcopy(model.net), pickle.loads(pickle.dumps(model.net))):
        assert clone._compiled_call_impl is None  # as torch does for nn.Module.compile()
        with torch.no_grad():
            clone[2].bias.fill_(100.0)
        assert torch.all(clone(x) > 50) and torch.all(model.net(x) < 50)
        assert list(clone.state_dict()) == list(model.net.state_dict())


class ManualRegressor(Regressor):
    """Manual optimization with a fused Adam: the scaler skips on the device."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        x, y = batch
        self.manual_backward(nn.functional.mse_loss(self.net(x).float(), y))
        opt.step()

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x).float(), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2, fused=True)


def test_manual_optimization_with_a_fused_optimizer_and_validation(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = ManualRegressor()
    reference = copy.deepcopy(model.net)
    plugin = _fp16_plugin()
    trainer, rec = _fit(model, plugin, epochs=1, clip=None)
    assert _same(rec.params[INF_STEP - 1], rec.params[INF_STEP])
    assert plugin.scaler.skipped_steps == 1

    net = amp_graph.compile(reference, policy="O1", dtype=torch.float16)
    opt = torch.optim.Adam(reference.parameters(), lr=1e-2, fused=True)
    scaler = amp_graph.GradScaler(init_scale=2.0**8, growth_interval=3)
    for x, y in _data(inf=True):
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(net(x).float(), y)).backward()
        scaler.step(opt)
        scaler.update()
    assert _same(model.net.parameters(), reference.parameters())

    # Validation runs through the same compiled child (in eval mode), without autocast.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        (metrics,) = trainer.validate(model, _data(inf=False), verbose=False)
    assert 0 < metrics["val_loss"] < 10

    # A checkpoint written with the plugin loads into a model without it: same keys.
    path = tmp_path / "manual.ckpt"
    trainer.save_checkpoint(path)
    plain = Regressor()
    plain.load_state_dict(torch.load(path, weights_only=False)["state_dict"])
    assert _same(plain.parameters(), model.parameters())


def test_the_monitor_option_watches_the_compiled_children(tmp_path: Path) -> None:
    """AmpGraphPrecision(monitor=...): one monitor per compiled child, the plugin's scaler
    known to it, a training step a step; the validation calls (no gradients) are not steps."""
    plugin = AmpGraphPrecision(
        policy="O1",
        dtype=torch.float16,
        scaler=amp_graph.GradScaler(init_scale=2.0**8),
        monitor={"every": 2, "log_dir": tmp_path},
    )
    model = ManualRegressor()
    trainer, _ = _fit(model, plugin, epochs=1, clip=None, inf=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.validate(model, _data(inf=False), verbose=False)
    (monitor,) = plugin.monitors.values()
    assert list(plugin.monitors) == ["net"]
    assert monitor.steps == STEPS_PER_EPOCH  # the validation batches counted no step
    history = monitor.history
    assert history.steps == [0, 2]
    assert {r["module"] for r in history} == {"0", "2"}  # net's two linears
    assert {r["loss_scale"] for r in history} == {2.0**8}
    assert (tmp_path / "monitor.jsonl").exists()
    with pytest.raises(TypeError, match="options as a dict"):
        AmpGraphPrecision(monitor=100)


class Classifier(pl.LightningModule):
    """Logits from a child, and the loss computed on them in ``training_step``, without a
    cast: what the plugin's ``output_dtype`` is for. Records each step's loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 5))
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_classifier(**trainer_options: Any) -> Classifier:
    torch.manual_seed(0)
    model = Classifier()
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 5, (16,), generator=gen)
    _fit_quietly(
        model, DataLoader(TensorDataset(x, y), batch_size=4), None, max_epochs=2, **trainer_options
    )
    return model


def test_the_loss_in_training_step_is_lightnings_bf16_mixed_bit_for_bit() -> None:
    """Lightning's ``precision="bf16-mixed"`` runs ``training_step`` under torch.autocast,
    which computes ``cross_entropy`` in float32; the plugin returns the child's logits in
    float32 (``output_dtype``'s default), and under ``policy="autocast"`` every loss and
    every parameter after 8 steps are Lightning's bit for bit. With ``output_dtype=None``
    the same ``training_step`` computes its loss in bf16."""
    expected = _fit_classifier(precision="bf16-mixed")
    assert all(loss.dtype == torch.float32 for loss in expected.losses)

    ours = _fit_classifier(plugins=[AmpGraphPrecision(policy="autocast", dtype=torch.bfloat16)])
    assert len(ours.losses) == len(expected.losses) == 8
    for got, want in zip(ours.losses, expected.losses, strict=True):
        assert got.dtype == torch.float32 and torch.equal(got, want)
    assert _same(ours.parameters(), expected.parameters())

    plugin = AmpGraphPrecision(policy="autocast", dtype=torch.bfloat16, output_dtype=None)
    low = _fit_classifier(plugins=[plugin])
    assert all(loss.dtype == torch.bfloat16 for loss in low.losses)
    assert not torch.equal(low.losses[0].float(), expected.losses[0])


def test_an_output_dtype_other_than_float32_is_refused_early() -> None:
    with pytest.raises(ValueError, match=r"AmpGraphPrecision\(output_dtype=\.\.\.\) is torch"):
        AmpGraphPrecision(dtype=torch.bfloat16, output_dtype=torch.float16)
