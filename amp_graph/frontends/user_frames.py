"""Where a warning should point: the user's line, however deep amp_graph called the warning.

A fixed ``stacklevel`` names the right frame only while the call path keeps its depth, and
entry points reach the same warning through different depths (``compile``, ``Graph``'s call,
the backend under dynamo). :func:`users_stacklevel` counts the frames instead.
"""

from __future__ import annotations

import functools
import os
import sys

import torch


@functools.cache
def _library_folders() -> tuple[str, ...]:
    import amp_graph.passes

    folders = (
        os.path.dirname(os.path.dirname(__file__)),  # amp_graph/
        os.path.dirname(amp_graph.passes.__file__),  # passes/, installed as amp_graph.passes
        os.path.dirname(torch.__file__),
    )
    return tuple(os.path.join(folder, "") for folder in folders)


def users_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` in the caller that names the first frame
    outside amp_graph and torch: the user's line (1 is the caller itself)."""
    folders = _library_folders()
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(folders):
        level, frame = level + 1, frame.f_back
    return level


__all__ = ["users_stacklevel"]
