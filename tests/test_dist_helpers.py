"""The harness that starts the distributed tests' gloo ranks (tests/dist_helpers.py): how a
rank starts, and that a rank's failure or stall fails the test instead of hanging it."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from dist_helpers import spawn_ranks


def _record_start(rank: int, out_dir: str) -> None:
    """Write whether amp_graph was already imported when the rank began (a forkserver's
    preload) or not (a fresh interpreter)."""
    (Path(out_dir) / f"rank{rank}.txt").write_text(str("amp_graph" in sys.modules))


def _raise_on_rank_one(rank: int) -> None:
    if rank == 1:
        raise RuntimeError("rank one fails on purpose")


def _sleep(rank: int, seconds: float) -> None:
    time.sleep(seconds)


@pytest.mark.parametrize(("start", "preloaded"), [(None, "False"), ("forkserver", "True")])
def test_ranks_start_fresh_unless_forkserver_is_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, start: str | None, preloaded: str
) -> None:
    if start is None:
        monkeypatch.delenv("AMP_GRAPH_TEST_RANK_START", raising=False)
    else:
        monkeypatch.setenv("AMP_GRAPH_TEST_RANK_START", start)
    spawn_ranks(_record_start, (str(tmp_path),), 2, tmp_path)
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)] == [preloaded] * 2


def test_an_unknown_start_method_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AMP_GRAPH_TEST_RANK_START", "fork")
    with pytest.raises(ValueError, match=r"AMP_GRAPH_TEST_RANK_START='fork'.*'spawn'"):
        spawn_ranks(_record_start, (str(tmp_path),), 2, tmp_path)


def test_a_failing_rank_fails_the_test_with_its_traceback(tmp_path: Path) -> None:
    with pytest.raises(mp.ProcessRaisedException, match="rank one fails on purpose"):
        spawn_ranks(_raise_on_rank_one, (), 2, tmp_path)


def test_a_stalled_rank_fails_at_the_deadline(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"slow ranks: ranks still running after 2 s"):
        spawn_ranks(_sleep, (60.0,), 2, tmp_path, join_seconds=2, name="slow ranks")
    assert time.monotonic() - start < 30
