"""AmpGraphPrecision on LightningModules whose blocks sit in containers (``nn.ModuleList``,
``nn.ModuleDict``), which are never called: the blocks they hold are compiled, and training
equals Lightning's ``precision="bf16-mixed"`` bit for bit (CPU, a few steps)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")

from test_lightning import _fit_quietly  # noqa: E402

from amp_graph.integrations.lightning import AmpGraphPrecision  # noqa: E402

VOCAB, WIDTH = 32, 16


class Blocks(pl.LightningModule):
    """Embedding, two linear blocks held by a container, a head; records each loss."""

    def __init__(self, container: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        layers = [nn.Linear(WIDTH, WIDTH) for _ in range(2)]
        self.blocks = (
            nn.ModuleList(layers)
            if container == "list"
            else nn.ModuleDict({"a": layers[0], "b": layers[1]})
        )
        self.head = nn.Linear(WIDTH, VOCAB)
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        ids, targets = batch
        h = self.emb(ids)
        for block in (
            self.blocks if isinstance(self.blocks, nn.ModuleList) else self.blocks.values()
        ):
            h = block(h)
        loss = nn.functional.cross_entropy(self.head(h).reshape(-1, VOCAB), targets.reshape(-1))
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _fit(container: str, **trainer_options: Any) -> Blocks:
    model = Blocks(container)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (8, 6), generator=gen)
    data = DataLoader(TensorDataset(ids, ids.roll(1, 1)), batch_size=4)
    _fit_quietly(model, data, None, max_steps=4, **trainer_options)
    return model


@pytest.mark.parametrize("container", ["list", "dict"])
def test_blocks_in_a_container_train_as_lightnings_bf16_mixed(container: str) -> None:
    expected = _fit(container, precision="bf16-mixed")
    ours = _fit(container, plugins=[AmpGraphPrecision(policy="autocast", dtype=torch.bfloat16)])
    assert len(ours.losses) == len(expected.losses) == 4
    for got, want in zip(ours.losses, expected.losses, strict=True):
        assert torch.equal(got, want)
    for (name, got), want in zip(ours.named_parameters(), expected.parameters(), strict=True):
        assert torch.equal(got, want), name


def test_a_container_is_looked_into_and_its_own_parameters_are_named() -> None:
    model = Blocks("list")
    model.blocks.append(nn.ParameterList([nn.Parameter(torch.ones(1))]))
    plugin = AmpGraphPrecision(dtype=torch.bfloat16, modules=["blocks"], monitor={"every": 1})
    with pytest.warns(UserWarning, match=r"holds parameters of its own \(blocks\.2\.0\)"):
        plugin.compile_modules(model)
    assert model.blocks._compiled_call_impl is None  # never called: nothing to compile
    assert sorted(plugin.monitors) == ["blocks.0", "blocks.1"]
    assert model.emb._compiled_call_impl is None  # not named in modules
