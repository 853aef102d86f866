"""Helpers for the tests that spawn gloo ranks with torch.multiprocessing."""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn


def end_rank() -> NoReturn:
    """End a rank's process after its results are written and its process group destroyed,
    without Python's interpreter finalization.

    At finalization gloo's worker threads may still hold finished work objects whose tensors
    are freed while the interpreter is being torn down; that aborts the process now and then
    ("terminate called without an active exception", SIGABRT; pytorch/pytorch#179291), which
    made a passing rank look failed. Nothing of the test runs after this point: a rank that
    fails still raises before it, and the spawning test still reads every rank's results."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now (for a process group's rendezvous)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _scenario_worker(
    rank: int,
    world: int,
    module: str,
    scenario: str,
    port: int,
    out_dir: str,
    timeout_seconds: float,
) -> None:
    import datetime
    import importlib
    import traceback
    from pathlib import Path

    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_seconds),
    )
    torch.set_num_threads(1)
    try:
        result = importlib.import_module(module).SCENARIOS[scenario](rank)
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    end_rank()


def _rank_with_faulthandler(rank: int, worker: Any, out_dir: str, *args: Any) -> None:
    """``worker(rank, *args)``, with every thread's Python stack written into
    ``out_dir/rank{rank}.fault`` if the rank dies of a fatal signal (faulthandler)."""
    import faulthandler
    from pathlib import Path

    # kept open for the rank's life: faulthandler writes into it when the signal comes
    fault_file = open(Path(out_dir) / f"rank{rank}.fault", "w")  # noqa: SIM115
    faulthandler.enable(fault_file, all_threads=True)
    worker(rank, *args)


# What a forkserver imports once before it forks each rank (AMP_GRAPH_TEST_RANK_START=forkserver,
# see spawn_ranks): torch, amp_graph and the distributed packages the tests' ranks use.
RANK_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "torch.distributed.tensor",
    "amp_graph",
    "dist_helpers",
]


def spawn_ranks(
    worker: Any,
    args: tuple,
    world: int,
    out_dir: Any,
    join_seconds: float = 150,
    name: str | None = None,
) -> None:
    """Run ``worker(rank, *args)`` in ``world`` processes and wait for them; fail, not hang,
    if a rank raises (its traceback in the error), dies of a signal (its threads' Python
    stacks in the error, from faulthandler's ``out_dir/rank{N}.fault``) or is still running
    after ``join_seconds``; each error names ``name`` (the worker's, if not given).

    The ranks start as fresh interpreters (torch.multiprocessing's ``"spawn"``).
    ``AMP_GRAPH_TEST_RANK_START=forkserver`` forks them instead from one server that imported
    :data:`RANK_PRELOAD` once: the nine files of distributed tests took 109 s here, not 296 s,
    but a rank died of SIGSEGV in the first whole suite run so (not again in five more whole
    suites, ten reruns of its file and 80 runs of scenarios): until that is understood, each
    rank pays its imports, and the variable is there to look for the crash."""
    import time
    from pathlib import Path

    import torch.multiprocessing as mp

    name = name or worker.__name__
    start_method = os.environ.get("AMP_GRAPH_TEST_RANK_START", "spawn")
    if start_method not in ("spawn", "forkserver"):
        raise ValueError(
            f"AMP_GRAPH_TEST_RANK_START={start_method!r}: 'spawn' (the default) or 'forkserver'"
        )
    if start_method == "forkserver":
        import multiprocessing

        multiprocessing.get_context("forkserver").set_forkserver_preload(RANK_PRELOAD)
    context = mp.start_processes(
        _rank_with_faulthandler,
        args=(worker, str(out_dir), *args),
        nprocs=world,
        join=False,
        start_method=start_method,
    )
    deadline = time.monotonic() + join_seconds
    try:
        while not context.join(timeout=max(deadline - time.monotonic(), 0)):
            if time.monotonic() >= deadline:
                raise AssertionError(f"{name}: ranks still running after {join_seconds} s")
    except mp.ProcessExitedException as died:  # a signal: what its threads were running
        fault = Path(out_dir) / f"rank{died.error_index}.fault"
        stacks = fault.read_text() if fault.exists() else "(no faulthandler output)"
        raise AssertionError(f"{name}: {died}\n{stacks}") from died
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()


def spawn_scenario(
    module: str,
    scenario: str,
    out_dir: Any,
    world: int,
    join_seconds: float = 150,
    collective_timeout_seconds: float = 60,
) -> list[Any]:
    """Run ``module.SCENARIOS[scenario](rank)`` on ``world`` gloo ranks and return each
    rank's result (saved by the rank with torch.save); fail, not hang, if a rank fails or
    stalls (``join_seconds`` for the whole run, ``collective_timeout_seconds`` for one
    collective: the process group's timeout)."""
    from pathlib import Path

    import torch

    args = (world, module, scenario, free_port(), str(out_dir), collective_timeout_seconds)
    spawn_ranks(_scenario_worker, args, world, out_dir, join_seconds, name=scenario)
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]
