"""Which ops the running CPU can compute in a low dtype, found by asking it.

A plan that lowers an op assumes a kernel for it in that dtype. On CPUs, some exist only
where the instruction set has them: oneDNN's bfloat16 LSTM needs AVX512-BF16 (or AMX), and
on an AVX2-only CPU ``nn.LSTM`` in bfloat16 raises "could not create a primitive descriptor
for the LSTM forward propagation primitive" at its first call (torch.autocast on the CPU
raises the same). amp_graph instead runs such an op in float32 there:

* :func:`missing_low_kernels` calls each op of :data:`PROBES` once per process and dtype,
  on a tiny input (forward and backward), and returns the ones that raise, with the first
  line of torch's error;
* :func:`amp_graph.frontends.policy_request.resolve` gives that map to the policy of every model
  compiled for the CPU (:attr:`amp_graph.Policy.missing_kernels`); its ``decide`` then
  computes those ops in float32 whatever the tables say, under the source ``"cpu"``, so
  ``explain`` shows why; the ``classify`` pass warns once per graph, naming the nodes.

Only ops whose CPU kernels depend on the instruction set are probed: the recurrent layers,
which reach oneDNN. Everything else has a kernel in every dtype on every x86 CPU (emulated
where slow), so probing it would only cost time.

>>> import torch
>>> missing_low_kernels(torch.float32)  # float32 is never missing
{}
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn as nn

log = logging.getLogger(__name__)


def _recurrent(layer: Callable[[], nn.Module], cell_state: bool = False) -> Callable:
    """A probe: a tiny two-layer recurrent layer in ``dtype``, forward and backward, with
    and without a given initial state (torch picks its kernel by both)."""

    def probe(dtype: torch.dtype) -> None:
        module = layer().to(dtype)
        data = torch.zeros(3, 2, 4, dtype=dtype)
        state = torch.zeros(2, 2, 8, dtype=dtype)
        for given in ((), ((state, state.clone()) if cell_state else state,)):
            out, _ = module(data, *given)
            out.float().sum().backward()

    return probe


PROBES: dict[str, Callable[[torch.dtype], None]] = {
    "lstm": _recurrent(lambda: nn.LSTM(4, 8, num_layers=2), cell_state=True),
    "gru": _recurrent(lambda: nn.GRU(4, 8, num_layers=2)),
    "rnn_tanh": _recurrent(lambda: nn.RNN(4, 8, num_layers=2)),
    "rnn_relu": _recurrent(lambda: nn.RNN(4, 8, num_layers=2, nonlinearity="relu")),
}
"""aten op name -> a call that computes it on the CPU in the dtype it is given."""


def missing_low_kernels(dtype: torch.dtype) -> dict[str, str]:
    """aten op name -> why this CPU cannot compute it in ``dtype`` (torch's error, first
    line), for the ops of :data:`PROBES`. Probed once per process and dtype (:func:`reprobe`
    forgets); ``{}`` for float32 and wherever every probe runs."""
    return dict(_probed(dtype))


@functools.cache
def _probed(dtype: torch.dtype) -> tuple[tuple[str, str], ...]:
    if dtype == torch.float32:
        return ()
    missing: list[tuple[str, str]] = []
    # the probes' layers initialize their weights from torch's generator: fork it, so that
    # compiling leaves the user's seeded stream where it was (dropout's masks included)
    with torch.enable_grad(), torch.random.fork_rng(devices=[]):
        for op, probe in PROBES.items():
            try:
                probe(dtype)
            except (RuntimeError, NotImplementedError) as error:
                first = (str(error).strip().splitlines() or [type(error).__name__])[0]
                missing.append((op, f"{cpu_name()}: {first}"))
    if missing:
        log.info("amp_graph: this CPU has no %s kernel for %s", dtype, [op for op, _ in missing])
    return tuple(missing)


def reprobe() -> None:
    """Forget what the probes found, so the next :func:`missing_low_kernels` asks again
    (after changing :data:`PROBES`)."""
    _probed.cache_clear()


def cpu_name() -> str:
    """The CPU's instruction-set level as torch sees it (``"AVX2"``, ``"AVX512"``), for
    messages."""
    try:
        return torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return "this CPU"


__all__ = ["PROBES", "cpu_name", "missing_low_kernels", "reprobe"]
