"""A model file for the CLI tests: `python -m amp_graph inspect tests/sample_model.py:SmallNet`."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class SmallNet(nn.Module):
    """Conv -> BatchNorm -> ReLU -> pool -> Linear -> softmax: O1 runs the conv and the
    linear in low precision and the softmax in float32."""

    def __init__(self, channels: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv(x)))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return F.softmax(self.head(x), dim=-1)


def make_tagger() -> nn.Module:
    """A factory: an embedding-based tagger that takes int64 token ids."""
    return nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 4))


class NeedsArguments(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class Untraceable(nn.Module):
    """Python control flow on a tensor value: symbolic tracing cannot follow it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.fc(x)
        return x


instance = SmallNet()
not_a_model = 3
