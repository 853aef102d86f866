"""Builds of the C++/CUDA extensions that a killed build cannot hang.

:func:`torch.utils.cpp_extension.load` serializes concurrent builds with a *baton*: a file
named ``lock`` in the build directory, created when a build starts and removed when it ends.
A process killed mid-build (Ctrl-C during the first monitored step, a test runner's timeout,
an OOM kill, a rank torn down) leaves that file behind, and every later ``load`` of the same
extension then waits for it forever, silently: the training step that first measures a
tensor never returns.

:func:`load_built` holds an operating-system lock (``fcntl.flock``) around the build instead.
The kernel releases it when its holder dies, so while amp_graph holds it no live amp_graph
build can be running, and a baton found then was left by a killed one: it is removed, with a
warning that says so (torch 2.15's own build took the same cure: an OS lock on that file,
which then stays, harmless; it is left alone there). Concurrent processes (one per rank)
still build once: the second waits on the lock, then loads what the first built.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

try:  # POSIX; elsewhere the build runs under cpp_extension's baton alone
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

logger = logging.getLogger(__name__)

BATON_NAME = "lock"  # cpp_extension's own lock file in a build directory
BUILD_LOCK_NAME = "amp_graph-build.flock"


def build_directory(name: str) -> Path:
    """Where extension ``name`` is built and cached, in cpp_extension's own layout (so caches
    from before are reused): ``$TORCH_EXTENSIONS_DIR/name`` where that is set, else
    ``~/.cache/torch_extensions/py311_cpu/name`` (one folder per Python ABI and accelerator
    build the library links against)."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        if torch.version.hip is not None:
            accelerator = "rocm" + torch.version.hip.replace(".", "")
        elif torch.version.cuda is not None:
            accelerator = "cu" + torch.version.cuda.replace(".", "")
        else:
            accelerator = "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(cpp_extension.get_default_build_root(), f"{python}_{accelerator}")
    return Path(root) / name


def torch_waits_on_a_baton() -> bool:
    """Whether this torch's cpp_extension waits while its ``lock`` file exists (its
    ``FileBaton``: torch 2.13). torch 2.15 holds an OS lock on that file instead, which it
    leaves in place after each build, harmless there."""
    from torch.utils import cpp_extension

    return hasattr(cpp_extension, "FileBaton")


@contextlib.contextmanager
def exclusive_build(directory: Path) -> Iterator[None]:
    """Hold this machine's build lock on ``directory`` (created if absent); inside, no other
    amp_graph build of it is alive, and a cpp_extension baton left there by a killed build is
    gone. Blocks while another process builds."""
    directory.mkdir(parents=True, exist_ok=True)
    if fcntl is None:  # pragma: no cover - Windows
        yield
        return
    with open(directory / BUILD_LOCK_NAME, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            baton = directory / BATON_NAME
            if torch_waits_on_a_baton() and baton.exists():
                logger.warning(
                    "amp_graph: removing %s, the lock file of an extension build that was "
                    "killed before it finished (it would make this build wait forever); "
                    "building again.",
                    baton,
                )
                baton.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_built(name: str, **load_arguments: object) -> object:
    """:func:`torch.utils.cpp_extension.load` of extension ``name`` in
    :func:`build_directory`, under :func:`exclusive_build`; returns what ``load`` returns."""
    from torch.utils import cpp_extension

    directory = build_directory(name)
    with exclusive_build(directory):
        return cpp_extension.load(name=name, build_directory=str(directory), **load_arguments)
