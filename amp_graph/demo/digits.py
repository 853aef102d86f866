"""A real, small dataset that ships inside a package: scikit-learn's handwritten digits.

1,797 8x8 grey images of the digits 0-9, read from the scikit-learn wheel (no download).
Used by the demo, the training tests and the notebooks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Split:
    x: torch.Tensor  # (n, 1, 8, 8) float32 in [0, 1]
    y: torch.Tensor  # (n,) int64 labels


def load_digits(test_fraction: float = 0.25, seed: int = 0) -> tuple[Split, Split]:
    """Train and test splits of scikit-learn's digits, shuffled with ``seed``."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError as error:
        raise ImportError(
            "the digits dataset comes with scikit-learn: pip install 'amp_graph[dev]' "
            "(or pip install scikit-learn)"
        ) from error
    bunch = sklearn_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    n_test = int(len(y) * test_fraction)
    return Split(x[n_test:], y[n_test:]), Split(x[:n_test], y[:n_test])


def batches(split: Split, batch_size: int, steps: int, seed: int = 0):
    """``steps`` random mini-batches (with replacement across epochs), reproducibly."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        index = torch.randint(0, len(split.y), (batch_size,), generator=generator)
        yield split.x[index], split.y[index]
