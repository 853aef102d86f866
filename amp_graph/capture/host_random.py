"""Random numbers the model's Python draws on the host while it is captured.

A graph records tensor operations. A number the forward draws from Python's ``random`` module
or numpy's global generator is drawn once, while export runs the forward, and the graph keeps
it as a constant for every later call: fairseq-style LayerDrop (``if random.random() < p:
continue``) would skip the same layers at every step, and SpecAugment (HF wav2vec2, HuBERT,
WavLM, Whisper's ``apply_spec_augment``: masks from ``np.random``) would mask the same frames.
Eager PyTorch and the torch.compile backend (dynamo draws these anew on each call) do not.
torch's own generators are not concerned: ``torch.rand``, ``torch.bernoulli`` and dropout are
ops of the graph and draw new values on each call.

:func:`host_draws` finds such draws from the two global generators' states before and
after the capture. A forward that seeds a generator itself before drawing (HF BigBird's random
attention seeds numpy with its layer's index while training) draws the same numbers on every
call, so one graph is faithful to it: the capture is then run a second time from another
starting state, and the draws count as the model's own only where both runs leave the
generator in the same state. Generators made by the model (``random.Random(...)``,
``np.random.default_rng()``) are not seen.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Where the second capture starts, for a forward that may seed its generators itself: any
# state the user's run is unlikely to be in
_OTHER_SEED = 0x5EED_A11


def _numpy_random() -> Any:
    """numpy's ``random`` module where the model may have used it (numpy imported), else None."""
    numpy = sys.modules.get("numpy")
    return getattr(numpy, "random", None) if numpy is not None else None


@dataclass(frozen=True)
class HostGenerators:
    """The states of Python's global ``random`` generator and numpy's global ``RandomState``
    (None where numpy is not imported)."""

    python: tuple
    numpy: tuple | None

    @classmethod
    def now(cls) -> HostGenerators:
        np_random = _numpy_random()
        return cls(random.getstate(), np_random.get_state() if np_random is not None else None)

    @classmethod
    def seeded(cls, seed: int) -> HostGenerators:
        np_random = _numpy_random()
        numpy_state = np_random.RandomState(seed).get_state() if np_random is not None else None
        return cls(random.Random(seed).getstate(), numpy_state)

    def restore(self) -> None:
        random.setstate(self.python)
        np_random = _numpy_random()
        if np_random is not None and self.numpy is not None:
            np_random.set_state(self.numpy)

    def moved(self, later: HostGenerators) -> list[str]:
        """The generators whose state differs in ``later``, by the names users call them."""
        names = []
        if self.python != later.python:
            names.append("Python's random")
        if not _same_numpy_state(self.numpy, later.numpy):
            names.append("numpy.random")
        return names


def _same_numpy_state(a: tuple | None, b: tuple | None) -> bool:
    """Legacy ``RandomState`` states: (name, key array, position, has_gauss, cached_gaussian)."""
    if a is None or b is None:
        return a is b
    return a[0] == b[0] and (a[1] == b[1]).all() and tuple(a[2:]) == tuple(b[2:])


def host_draws(before: HostGenerators, capture: Callable[[], Any]) -> list[str]:
    """The global host generators the capture that just ran from ``before`` drew from, where
    one graph would fix those numbers for every call (empty: none).

    ``capture`` runs the same capture again (its result is discarded); it is called only
    where a generator moved, to tell a forward that seeds the generator itself from one that
    continues the user's sequence. The generators are left as the first capture left them,
    as the model's own forward would have.
    """
    after = HostGenerators.now()
    moved = before.moved(after)
    if not moved:
        return []
    HostGenerators.seeded(_OTHER_SEED).restore()
    try:
        capture()
        continued = after.moved(HostGenerators.now())
    except Exception:
        continued = moved
    finally:
        after.restore()
    return [name for name in moved if name in continued]


def host_draws_message(model_name: str, generators: list[str]) -> str:
    """What a capture that drew from ``generators`` raises: why one graph cannot, the usual
    sources, and the ways out."""
    whose = "its global generator" if len(generators) == 1 else "their global generators"
    return (
        f"amp_graph cannot capture {model_name} as one graph: its forward drew random "
        f"numbers from {' and '.join(generators)} ({whose}) while it was traced, "
        "and a graph would keep those numbers for every later call (the same "
        "layers skipped, the same positions masked, at every step) where the model draws "
        "new ones on each call. Usual sources: LayerDrop written as `random.random() < p` "
        "or `np.random.random()`, SpecAugment masks (HF wav2vec2, HuBERT, WavLM, Whisper: "
        "config.mask_time_prob, mask_feature_prob, apply_spec_augment). Ways out: "
        "torch.compile(model, backend='amp_graph'), which draws them anew on every call; "
        "torch's generator in the model (torch.rand, torch.bernoulli: ops of the graph); "
        "the draws made outside and passed in (HF's speech models take "
        "mask_time_indices=); or the feature off (layerdrop=0.0, mask_time_prob=0.0)."
    )


__all__ = ["HostGenerators", "host_draws", "host_draws_message"]
