"""Helpers for the tests that spawn gloo ranks with torch.multiprocessing."""

from __future__ import annotations

import os
import sys
from typing import NoReturn


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
