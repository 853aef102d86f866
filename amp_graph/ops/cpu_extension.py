"""Build-on-first-use loader of the CPU extension behind the monitor's statistics.

``csrc/tensor_stats_cpu.cpp`` is one pass over a tensor that accumulates every statistic of
:mod:`amp_graph.ops.tensor_stats` (a dozen torch ops otherwise, each reading the tensor and
allocating a mask). :func:`load_cpu_extension` compiles it with
:func:`torch.utils.cpp_extension.load` the first time a monitor measures a CPU tensor (about
half a minute; needs a C++ compiler and ``pip install ninja``), cached in
``TORCH_EXTENSIONS_DIR`` under a name keyed by the torch build (a build killed midway cannot
hang the next one: :mod:`amp_graph.ops.extension_build`). Where it cannot be built,
or ``AMP_GRAPH_DISABLE_CPU_EXT=1`` is set, the statistics are computed with torch ops: the
same numbers, more passes over memory.
"""

from __future__ import annotations

import logging
import os
import re
import threading

import torch

from .cuda_extension import CSRC_DIR, ExtensionStatus, torch_cxx_standard
from .extension_build import load_built

logger = logging.getLogger(__name__)

DISABLE_ENV = "AMP_GRAPH_DISABLE_CPU_EXT"
SOURCES = ("tensor_stats_cpu.cpp",)

_lock = threading.Lock()
_status = ExtensionStatus("not-tried", "")


def cpu_extension_status() -> ExtensionStatus:
    """``not-tried``, ``loaded`` (with its path), ``disabled`` or ``failed`` (with the error)."""
    return _status


def vector_flags(capability: str) -> tuple[str, ...]:
    """Compiler flags for the vector instructions torch found on this CPU
    (``torch.backends.cpu.get_cpu_capability()``): AVX2 where it has AVX2 or AVX-512 (8 floats
    a compare), else the compiler's default (SSE2 on x86-64)."""
    return ("-mavx2", "-mfma") if capability in ("AVX2", "AVX512") else ()


def extension_name(torch_version: str, capability: str) -> str:
    """The cache name: one per torch build (an extension links against one torch) and
    instruction set (a cache shared with an older CPU must not hand it AVX2 code).

    >>> extension_name("2.13.0+cpu", "AVX512")
    'amp_graph_cpu_kernels_torch2_13_0_cpu_avx2'
    """
    suffix = "_avx2" if vector_flags(capability) else ""
    return "amp_graph_cpu_kernels_torch" + re.sub(r"[^0-9A-Za-z]+", "_", torch_version) + suffix


def load_cpu_extension() -> bool:
    """Build (first use on this machine) and load the CPU kernels; True when they are in.
    A failure is logged once as a warning and not retried in this process."""
    global _status
    if _status.state != "not-tried":
        return _status.state == "loaded"
    with _lock:
        if _status.state != "not-tried":
            return _status.state == "loaded"
        if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
            _status = ExtensionStatus("disabled", f"{DISABLE_ENV} is set")
            return False
        try:
            capability = torch.backends.cpu.get_cpu_capability()
            name = extension_name(torch.__version__, capability)
            load_built(
                name,
                sources=[str(CSRC_DIR / source) for source in SOURCES],
                extra_cflags=["-O3", f"-std={torch_cxx_standard()}", *vector_flags(capability)],
                is_python_module=False,
                verbose=logger.isEnabledFor(logging.DEBUG),
            )
        except Exception as error:  # compiler, ninja or loader errors all mean "use torch ops"
            _status = ExtensionStatus("failed", f"{type(error).__name__}: {error}")
            logger.warning(
                "amp_graph: building the CPU statistics kernel failed (%s); the monitor computes "
                "its statistics with torch ops (same numbers, slower logging steps). The build "
                "needs a C++ compiler and `pip install ninja`.",
                _status.detail.splitlines()[0],
            )
            return False
        _status = ExtensionStatus("loaded", name)
        return True
