"""The training Graph the Graph tests share: a model, cross-entropy, one optimizer and
the config options as keyword arguments."""

from __future__ import annotations

import torch
import torch.nn as nn

from amp_graph.training.nn_graph import Graph

FP16 = torch.float16


class TrainGraph(Graph):
    def __init__(
        self,
        model,
        optimizer,
        *,
        scheduler=None,
        policy="O1",
        dtype=FP16,
        scaler=None,
        amp=True,
        clip=None,
        accumulation=1,
    ):
        super().__init__()
        self.model = model
        self.loss_fn = nn.CrossEntropyLoss()
        self.add_optimizer(optimizer, lr_sch=scheduler)
        self.config.enable_amp(amp, policy=policy, dtype=dtype)
        if scaler is not None:
            self.set_grad_scaler(scaler)
        if clip is not None:
            self.config.set_gradient_clipping(clip)
        if accumulation > 1:
            self.config.set_gradient_accumulation_steps(accumulation)

    def build(self, x, y):
        loss = self.loss_fn(self.model(x).float(), y)
        loss.backward()
        return loss
