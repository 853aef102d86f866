"""Build-on-first-use loader of the CUDA extension behind the ``amp_graph`` ops.

The extension (``csrc/amp_kernels.cu``, ``csrc/binding.cpp``, ``csrc/python_entry.cpp``) is
compiled by
:func:`torch.utils.cpp_extension.load` the first time a CUDA tensor reaches one of the ops, for
the architectures of the visible GPUs, and cached in ``TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``) under a name keyed by the torch build and those architectures
(:func:`build_options`), so a cache shared between machines never hands one GPU another's
binary; later processes load the cached library. Nothing is compiled at ``pip install``, and a
machine without a CUDA device never tries: :func:`load_extension` returns ``False`` there and the
ops use their torch-native implementation, which has the same semantics.

Set ``AMP_GRAPH_DISABLE_CUDA_EXT=1`` to skip the extension on a CUDA machine as well.

Example::

    >>> from amp_graph.ops.cuda_extension import extension_status
    >>> extension_status().state  # on a CPU-only machine, before and after any op call
    'unavailable'
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import re
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC_DIR = Path(__file__).resolve().parent / "csrc"
SOURCES = ("binding.cpp", "python_entry.cpp", "amp_kernels.cu")
DISABLE_ENV = "AMP_GRAPH_DISABLE_CUDA_EXT"
# No --use_fast_math: the unscale must round like torch's.
NVCC_FLAGS = ("-O3", "-lineinfo")
CXX_FLAGS = ("-O3",)

Arch = tuple[int, int]  # a compute capability, (9, 0) for sm_90


@functools.lru_cache(maxsize=1)
def torch_cxx_standard() -> str:
    """The C++ standard the installed torch's extension builds compile with: ``"c++20"`` on
    torch 2.13 to 2.15 (2.15's headers need it: ``std::bit_width``), ``"c++17"`` where
    torch passes no standard of its own.

    Read from the flags :mod:`torch.utils.cpp_extension` writes into its build files (the
    quoted ``'-std=c++NN'`` literals of its source), so that the build here, and the tests
    that compile the sources by hand, use what torch's headers were written for.

    >>> torch_cxx_standard() in ("c++17", "c++20", "c++23")
    True
    """
    from torch.utils import cpp_extension

    found = re.findall(r"""['"]-std=c\+\+(\d+)['"]""", inspect.getsource(cpp_extension))
    return f"c++{max(int(n) for n in found)}" if found else "c++17"


def build_options(torch_version: str, archs: list[Arch]) -> dict[str, object]:
    """``name`` and ``extra_cuda_cflags`` of the build for GPUs of compute capabilities ``archs``.

    cpp_extension rebuilds when sources or flags change, but its cache directory is found by
    name alone, so the name carries the torch build and the architectures. The flags give one
    SASS per architecture plus PTX of the newest (cpp_extension adds no arch flags of its own
    when some are given).

    >>> build_options("2.11.0+cu130", [(9, 0)])["name"]
    'amp_graph_kernels_torch2_11_0_cu130_sm90'
    """
    if not archs:
        raise ValueError("build_options needs the compute capability of at least one GPU")
    unique = sorted(set(archs))
    codes = [f"{major}{minor}" for major, minor in unique]
    gencode = [f"-gencode=arch=compute_{c},code=sm_{c}" for c in codes]
    gencode.append(f"-gencode=arch=compute_{codes[-1]},code=compute_{codes[-1]}")
    return {
        "name": "amp_graph_kernels_torch"
        + re.sub(r"\W", "_", torch_version)
        + "".join(f"_sm{c}" for c in codes),
        # the standard torch's headers need, said here too so that the nvcc line and the
        # tests' compiles are the same as torch's (torch adds none once one is given)
        "extra_cuda_cflags": [*NVCC_FLAGS, f"-std={torch_cxx_standard()}", *gencode],
    }


def load_arguments(archs: list[Arch]) -> dict[str, object]:
    """The arguments of :func:`torch.utils.cpp_extension.load` that build the extension for
    GPUs of compute capabilities ``archs`` with the installed torch (the tests build with
    them too)."""
    return {
        **build_options(torch.__version__, archs),
        "sources": [str(CSRC_DIR / source) for source in SOURCES],
        "extra_include_paths": [str(CSRC_DIR)],
        "extra_cflags": [*CXX_FLAGS, f"-std={torch_cxx_standard()}"],
        # a Python module (python_entry.cpp); importing it registers the kernels as well
        "is_python_module": True,
    }


def visible_archs() -> list[Arch]:
    """Compute capabilities of the GPUs this process sees."""
    return sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})


@dataclasses.dataclass(frozen=True)
class ExtensionStatus:
    """Where the CUDA extension stands in this process.

    ``state`` is one of ``"not-tried"`` (no CUDA tensor has reached an op yet), ``"loaded"``,
    ``"unavailable"`` (no CUDA device: never built), ``"disabled"`` (by the
    ``AMP_GRAPH_DISABLE_CUDA_EXT`` variable) or ``"failed"`` (the build or load raised; ``detail``
    says why, and the ops fall back to torch).
    """

    state: str
    detail: str = ""


_lock = threading.Lock()
_status = ExtensionStatus("not-tried")
_module: object | None = None  # the loaded extension's Python module (python_entry.cpp)


def extension_status() -> ExtensionStatus:
    """Return the extension's state without building anything.

    A CPU-only process reports ``"unavailable"`` at once; a CUDA process reports ``"not-tried"``
    until the first op call on a CUDA tensor.
    """
    if _status.state == "not-tried" and not _cuda_usable():
        return ExtensionStatus("unavailable", "no CUDA device")
    return _status


def python_entry() -> object | None:
    """The loaded extension's unboxed entry into the ops (``csrc/python_entry.cpp``: functions
    ``check_and_unscale``, ``check``, ``check_unscale_and_norm``), or None while it is not
    loaded. Builds nothing."""
    return _module


def _cuda_usable() -> bool:
    return torch.version.cuda is not None and torch.cuda.is_available()


def load_extension() -> bool:
    """Build (first use on this machine) and load the extension; True when its kernels are in.

    Loading registers the ops' ``CUDA`` kernels with the dispatcher (``TORCH_LIBRARY_IMPL`` in
    ``csrc/binding.cpp``); from then on CUDA calls go straight to C++. Thread-safe; concurrent
    processes (one per rank) are serialized by an OS lock on the build directory, which a
    killed build cannot leave held (:mod:`amp_graph.ops.extension_build`). A failure is logged
    once as a warning and not retried in this process.
    """
    global _status, _module
    if _status.state != "not-tried":
        return _status.state == "loaded"
    with _lock:
        if _status.state != "not-tried":
            return _status.state == "loaded"
        if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
            _status = ExtensionStatus("disabled", f"{DISABLE_ENV} is set")
            logger.info("amp_graph CUDA extension disabled by %s", DISABLE_ENV)
            return False
        if not _cuda_usable():
            _status = ExtensionStatus("unavailable", "no CUDA device")
            return False
        try:
            from .extension_build import load_built

            arguments = load_arguments(visible_archs())
            module = load_built(
                str(arguments.pop("name")), **arguments, verbose=logger.isEnabledFor(logging.DEBUG)
            )
        except Exception as error:  # compiler, ninja or loader errors all mean "use torch ops"
            _status = ExtensionStatus("failed", f"{type(error).__name__}: {error}")
            logger.warning(
                "amp_graph: building the CUDA extension failed (%s); the ops fall back to "
                "torch's native implementation (same results, more passes over memory). "
                "The build needs nvcc (CUDA_HOME), a host C++ compiler and `pip install ninja`.",
                _status.detail,
            )
            return False
        _module = module
        _status = ExtensionStatus("loaded", str(getattr(module, "__file__", module)))
        logger.info("amp_graph CUDA extension loaded from %s", _status.detail)
        return True
