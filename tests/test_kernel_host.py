"""CUDA sources checked on a CPU-only machine.

* ``csrc/host_selftest.cpp`` (built with g++, or nvcc) runs the kernel's host-side logic: the index
  math of ``csrc/tiling.h`` (whole simulated launches over many sizes, misalignments and tables,
  large tensors by blocks and small ones packed into shared tiles by warps), the bit-level
  finiteness tests, the scale-update rule (compared with the Python op), the device-table cache
  of ``csrc/table_cache.h`` (built once per parameter set, kept while a CUDA graph uses it), the
  launch plans of ``csrc/launch_plan.h`` (found again by the gradient list's fingerprint) and
  the grid-limit cache of ``csrc/launch_cache.h`` (occupancy asked once per device and kernel);
* ``csrc/amp_kernels.cu`` is compiled for real with ``nvcc -c`` when nvcc exists;
* ``csrc/binding.cpp`` and ``csrc/python_entry.cpp`` are compiled (``-fsyntax-only``) against
  torch's headers;
* where torch is a CUDA build (the registry's wheel, even on a machine without a GPU) and
  nvcc and ninja exist, the whole extension is built and loaded by torch's own
  ``cpp_extension.load``, as a GPU user's first step builds it.

Every compile uses the C++ standard torch's own extension builds use
(:func:`amp_graph.ops.cuda_extension.torch_cxx_standard`: C++20 on torch 2.13 to 2.15, whose
headers need it). The compiles start together (2 cores) and each test waits for its own.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from amp_graph.ops import scaler_ops as ops
from amp_graph.ops.cuda_extension import CSRC_DIR, torch_cxx_standard

pytestmark = pytest.mark.cuda  # CUDA sources: `make gpu-check` runs these too

NVCC = shutil.which("nvcc")
CXX = shutil.which("g++") or shutil.which("c++")
HOST_COMPILER = CXX or NVCC
TIMEOUT = 300
STD = torch_cxx_standard()


def _cuda_include() -> Path | None:
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    if NVCC:
        candidates.append(str(Path(NVCC).resolve().parent.parent))
    candidates.append("/usr/local/cuda")
    for root in filter(None, candidates):
        include = Path(root) / "include"
        if (include / "cuda_runtime_api.h").exists():
            return include
    return None


def _binding_command(stub_dir: Path, source: str = "binding.cpp") -> list[str] | None:
    """g++ -fsyntax-only over a torch-facing source, or None when headers or compiler are
    missing."""
    cuda_include = _cuda_include()
    if CXX is None or cuda_include is None:
        return None
    from torch.utils import cpp_extension

    torch_includes = cpp_extension.include_paths()
    # CPU wheels ship the c10/cuda headers but not this generated one; supply it.
    macros = Path("c10/cuda/impl/cuda_cmake_macros.h")
    if not any((Path(p) / macros).exists() for p in torch_includes):
        (stub_dir / macros).parent.mkdir(parents=True, exist_ok=True)
        (stub_dir / macros).write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    includes = [*torch_includes, str(stub_dir), sysconfig.get_paths()["include"], str(cuda_include)]
    return [
        CXX,
        f"-std={STD}",
        "-fsyntax-only",
        "-Wall",
        "-Wextra",
        "-Werror",
        *(f"-isystem{p}" for p in includes),
        f"-I{CSRC_DIR}",
        "-DTORCH_EXTENSION_NAME=amp_graph_kernels",
        str(CSRC_DIR / source),
    ]


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.Popen, Path]]:
    out = tmp_path_factory.mktemp("kernel_builds")
    jobs: dict[str, tuple[list[str], Path]] = {}
    if HOST_COMPILER is not None:
        exe = out / "host_selftest"
        flags = [f"-std={STD}", "-O2", "-pthread"] + (
            ["-Wall", "-Wextra", "-Werror"] if CXX else []
        )
        src = str(CSRC_DIR / "host_selftest.cpp")
        if CXX is None:  # nvcc compiles a .cpp as host code
            flags = ["-O2", "-x", "cu"]
        jobs["host"] = ([HOST_COMPILER, *flags, f"-I{CSRC_DIR}", src, "-o", str(exe)], exe)
    if NVCC is not None:
        from torch.utils import cpp_extension

        obj = out / "amp_kernels.o"
        # The flags torch's JIT build adds (they forbid implicit half conversions).
        torch_flags = getattr(cpp_extension, "COMMON_NVCC_FLAGS", [])
        command = [
            NVCC, "-c", f"-std={STD}", "-O3", "-arch=sm_90", "-Werror", "all-warnings",
            *torch_flags, f"-I{CSRC_DIR}", str(CSRC_DIR / "amp_kernels.cu"), "-o", str(obj),
        ]  # fmt: skip
        jobs["nvcc"] = (command, obj)
    for source in ("binding.cpp", "python_entry.cpp"):
        command = _binding_command(out, source)
        if command is not None:
            jobs[source] = (command, out / f"{source}.ok")
    started = {
        name: (
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
            target,
        )
        for name, (cmd, target) in jobs.items()
    }
    yield started
    for process, _ in started.values():
        if process.poll() is None:
            process.kill()


def _finish(builds: dict, name: str, why: str) -> Path:
    if name not in builds:
        pytest.skip(why)
    process, target = builds[name]
    output, _ = process.communicate(timeout=TIMEOUT)
    assert process.returncode == 0, output
    return target


def _selftest(builds, mode: str) -> str:
    exe = _finish(builds, "host", "no host C++ compiler (g++ or nvcc)")
    run = subprocess.run([exe, mode], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"OK {mode}" in run.stdout, run.stdout
    return run.stdout


def test_tiling_covers_every_element_exactly_once(builds) -> None:
    """Blocks on large tensors, warps on packed small ones: every element exactly once, every
    vector aligned and in bounds, shared tiles within budget and free of large tensors."""
    _selftest(builds, "tiling")


def test_small_tensors_share_tiles(builds) -> None:
    """10,000 tensors of 100 floats take 286 tiles, not 10,000 (one per tensor before)."""
    out = _selftest(builds, "packing")
    assert "packing 10000 x 100 (4-byte): 286 tiles" in out, out


def test_bit_level_finiteness_matches_isfinite(builds) -> None:
    _selftest(builds, "finite")


def test_device_table_cache(builds) -> None:
    """Hit for the same rows on the same device, miss otherwise; LRU eviction frees buffers;
    entries pinned by a CUDA graph capture are never evicted; the table writer's chunks cover
    the table exactly once."""
    _selftest(builds, "cache")


def test_launch_plans_are_found_by_fingerprint(builds) -> None:
    """The per-call host work of a repeated gradient list is its fingerprint: the same list hits;
    a change of count, address, dtype, size or order misses and rebuilds the per-call plan;
    non-dense tensors and other dtypes are never fingerprinted; a list of 3000 tensors in three
    dtype groups (three kernel launches, a table of three write launches) hits and misses by its
    last tensor."""
    _selftest(builds, "plan")


def test_grid_limits_are_queried_once(builds) -> None:
    """The occupancy and multiprocessor queries run once per (device, dtype, mode), from any
    number of threads."""
    _selftest(builds, "launch")


@pytest.mark.parametrize(
    ("growth", "backoff", "interval", "hysteresis", "min_scale", "max_scale"),
    [
        (2.0, 0.5, 3, 1, 0.0, float("inf")),
        (2.0, 0.5, 2, 3, 1.0, 2.0**12),
        (1.7, 0.3, 1, 2, 0.01, 1e5),
        (3.0, 0.9, 4, 1, 0.0, 3.4e38),  # growth past float32's range must be refused
    ],
)
def test_cpp_update_rule_matches_python_op(
    builds, growth, backoff, interval, hysteresis, min_scale, max_scale
) -> None:
    """The C++ rule (used by the CUDA kernel) and the torch-native op agree bit for bit."""
    exe = _finish(builds, "host", "no host C++ compiler (g++ or nvcc)")
    rng = random.Random(interval * 7 + hysteresis)
    flags = "".join("1" if rng.random() < 0.35 else "0" for _ in range(80)) + "0" * 60
    init = 2.0**14 if max_scale > 2.0**14 else max_scale
    params = [growth, backoff, interval, hysteresis, min_scale, max_scale, init]
    run = subprocess.run(
        [
            exe,
            "update",
            *(repr(float(p)) if isinstance(p, float) else str(p) for p in params),
            flags,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    scale = torch.tensor(init)
    trackers = torch.tensor([0, hysteresis, 0, 0])
    for line, flag in zip(run.stdout.split("\n"), flags, strict=False):
        found = torch.tensor(float(flag))
        ops.update_scale_(
            scale, trackers, found, growth, backoff, interval, hysteresis, min_scale, max_scale
        )
        bits = struct.unpack("<I", struct.pack("<f", scale.item()))[0]
        assert line.split() == [f"{bits:08x}", *map(str, trackers.tolist())]
    assert len(run.stdout.split("\n")) == len(flags) + 1


def test_nvcc_compiles_the_kernels(builds) -> None:
    obj = _finish(builds, "nvcc", "nvcc not found")
    assert obj.stat().st_size > 0


@pytest.mark.parametrize("source", ["binding.cpp", "python_entry.cpp"])
def test_binding_compiles_against_torch_headers(builds, source: str) -> None:
    _finish(builds, source, "no C++ compiler or CUDA headers")


# --- the extension, built and loaded by torch's own cpp_extension.load ----------------------

_BUILD_AND_LOAD = """
import sys, torch
from torch.utils import cpp_extension
from amp_graph.ops.cuda_extension import load_arguments
module = cpp_extension.load(**load_arguments([(9, 0)]), build_directory=sys.argv[1])
print(sorted(n for n in dir(module) if not n.startswith("_")))
print(sorted(n for n in torch._C._dispatch_get_registrations_for_dispatch_key("AutogradCUDA")
             if n.startswith("amp_graph::")))
print(sorted(n for n in torch._C._dispatch_get_registrations_for_dispatch_key("CUDA")
             if n.startswith("amp_graph::")))

# python_entry.cpp's functions make the dispatcher call on any device: on the CPU they reach the
# ops' torch-native kernels, so their borrowing and declining can be tested without a GPU.
import json
from torch.overrides import TorchFunctionMode
import amp_graph.ops.scaler_ops  # noqa: F401  (the schemas)

class Sub(torch.Tensor):
    pass

grads = [torch.tensor([2.0, float("inf")]), torch.tensor([4.0], dtype=torch.bfloat16)]
refs = [g._use_count() for g in grads]  # the C++ TensorImpl's count: borrowing leaves it
found, inv = torch.zeros(()), torch.tensor(0.5)
ran_list = module.check_and_unscale(grads, found, inv)
ran_tuple = module.check_and_unscale(tuple(grads), found, inv)
values = [g.float().tolist() for g in grads]
sub = [grads[0], torch.ones(2).as_subclass(Sub)]
declined_subclass = module.check_and_unscale(sub, found, inv)
declined_flag = module.check(grads, torch.zeros(()).as_subclass(Sub))
declined_other = module.check_and_unscale(iter(grads), found, inv)
with TorchFunctionMode():
    declined_mode = module.check_and_unscale(grads, found, inv)
norm = module.check_unscale_and_norm([torch.tensor([3.0, 4.0])], torch.zeros(()), inv)
try:
    module.check([torch.tensor([1, 2])], torch.zeros(()))
    error = None
except Exception as e:
    error = f"{type(e).__name__}: {e}"
print(json.dumps({
    "ran": [ran_list, ran_tuple], "values": values, "found": found.item(),
    "declined": [declined_subclass, declined_flag, declined_other, declined_mode],
    "norm": norm.item(), "error": error, "refs": refs == [g._use_count() for g in grads],
}))
"""


def _why_no_torch_build() -> str | None:
    from torch.utils import cpp_extension

    if torch.version.cuda is None:
        return "torch is a CPU build: no CUDA libraries to link the extension against"
    if NVCC is None or _cuda_include() is None:
        return "nvcc or the CUDA headers not found"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja): torch's JIT build needs it"
    release = subprocess.run([NVCC, "--version"], capture_output=True, text=True).stdout
    found = re.search(r"release (\d+)\.", release)
    if found is None or found.group(1) != torch.version.cuda.split(".")[0]:
        return f"nvcc ({release.strip().splitlines()[-1]}) is not CUDA {torch.version.cuda}'s major"
    return None


def test_the_extension_builds_and_loads_with_torchs_own_build(tmp_path: Path) -> None:
    """What a GPU user's first CUDA step does: cpp_extension.load of our sources with the
    installed torch (its headers, its flags, our -std): it compiles, links against torch's
    CUDA libraries, loads, and registers a CUDA kernel for every amp_graph op."""
    why = _why_no_torch_build()
    if why is not None:
        pytest.skip(why)
    env = {**os.environ, "CUDA_HOME": str(_cuda_include().parent)}
    run = subprocess.run(
        [sys.executable, "-c", _BUILD_AND_LOAD, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    entry, autograd, registered, calls = run.stdout.strip().splitlines()[-4:]
    for op in ops.SCHEMAS:
        assert f"amp_graph::{op}" in registered, registered
    for op in [name for name in ops.SCHEMAS if name != "update_scale_"]:  # the list ops
        assert f"amp_graph::{op}" in autograd, autograd
    for function in ("check", "check_and_unscale", "check_unscale_and_norm"):
        assert f"'{function}'" in entry, entry
    # the unboxed entry: a list or tuple of exact tensors runs the op (twice: 2 -> 1 -> 0.5)
    result = json.loads(calls)
    assert result["ran"] == [True, True]
    assert result["values"] == [[0.5, float("inf")], [1.0]] and result["found"] == 1.0
    # a subclass (list or flag), another iterable, a torch function mode: declined, untouched
    assert result["declined"] == [False, False, False, False]
    assert result["norm"] == 6.25  # (3/2)^2 + (4/2)^2
    assert result["error"] is not None and result["error"].startswith("ValueError: amp_graph")
    assert result["refs"], "borrowed tensors must keep their reference counts"


def test_the_kernel_sweep_builds_the_librarys_kernel_with_its_knobs(tmp_path: Path) -> None:
    """benchmarks/kernel_sweep.py measures the library's own kernel source: every knob it sets
    is one the sources define (with the library's default), and a variant builds with nvcc."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import kernel_sweep

    sources = (CSRC_DIR / "tiling.h").read_text() + (CSRC_DIR / "amp_kernels.cu").read_text()
    knobs = {name for flags in kernel_sweep.VARIANTS.values() for name in flags}
    assert knobs == {
        "AMP_GRAPH_UNROLL", "AMP_GRAPH_TILE_VECS", "AMP_GRAPH_MIN_BLOCKS", "AMP_GRAPH_STREAMING",
        "AMP_GRAPH_CONTIGUOUS_TILES",
    }  # fmt: skip
    for name in knobs:
        assert f"#ifndef {name}\n#define {name} " in sources, name
    assert kernel_sweep.VARIANTS["base"] == {}
    if NVCC is None:
        pytest.skip("nvcc not found: the knobs were checked, the build was not")
    # one build with every kind of knob: launch bounds, unroll, the contiguous tile order
    flags = kernel_sweep.VARIANTS["unroll 8, min 3"] | kernel_sweep.VARIANTS["contiguous tiles"]
    exes = kernel_sweep.build_all({"every knob": flags}, tmp_path, "sm_90")
    assert exes["every knob"].stat().st_size > 0
