"""``make gpu-check``: every CUDA test and the GPU benchmarks in one command, figures written into
BENCHMARKS.md's GPU table.

    python benchmarks/gpu_check.py                      # what `make gpu-check` runs
    python benchmarks/gpu_check.py --no-write           # print the table, leave BENCHMARKS.md

Stages, each with its own time limit, all within --budget seconds (460 by default: the command
within 8 minutes, issue 58). The tests run first; then the stages whose figures the results JSON
has never held, then those with the oldest (:func:`stage_order`; among equals, the order
below). A stage is started only with the time it took when it last completed left (with a
margin; half its limit if it never completed; :func:`seconds_needed`), else it shows the
earlier run's figures and the time goes to the stages after it: one call cannot hold every
stage (the last run's took 386 s, and four stages new since are held to 520 s), so each call
measures what the one before left out.

1. the CUDA tests: ``pytest -m cuda``: every test that skips without a GPU (tests/conftest.py
   marks them) and tests/test_kernel_host.py (the CUDA sources compiled and their host logic);
   on a GPU none may skip; in 4 pytest-xdist processes sharing the GPU (they compile on the
   CPU: 140 s in one process on 2026-11-28);
1b. ``benchmarks/compile_modes.py --device cuda``: ``amp_graph.compile``'s modes (the default,
   inductor, first) against the eager autocast loop and torch.compile's, on a 2-layer GPT of
   width 768 (8x512 tokens);
1c. ``benchmarks/fp8_cost_model.py --device cuda``: the per-GEMM fp8 cost model measured on
   this GPU, its predictions against measured layer times at GPT-2's and a Llama stack's shapes;
1d. ``benchmarks/mfu.py --device cuda --batches 16 32 64``: GPT-2 small's Graph step (O1 bf16,
   inductor, one CUDA graph) as a share of the bf16 peak, at the smallest batch that reaches
   40%, with its FLOP count;
1e. ``benchmarks/fp8_step.py --device cuda``: the fp8 step of a Llama stack (4x4096, 8x2048
   tokens) against the bf16 ``torch.compile`` step and torchao's float8 (if installed), then
   the loss after 200 steps against bf16's noise;
2. ``benchmarks/cuda_graph_bench.py``: ``Graph.config.enable_cuda_graph`` on the GPT-2-small
   shape (8 and 64 x 512 tokens, bf16 and fp16) against the hand-written autocast loop and
   (bf16, 8x512) the ``torch.compile(mode="reduce-overhead")`` loop, also with
   ``config.enable_compile()`` (inductor's kernels captured whole), and its step's memory;
3. ``benchmarks/eager_step.py --device cuda --gpt2``: what ``recompute_casts="auto"``
   measures on this GPU and decides on GPT-2 small's shape, and the compiled O1 step against
   torch.autocast with it, with every cast recomputed and with none;
4. ``benchmarks/graph_step_cuda.py``: host syncs per Graph step, and the Graph step captured in
   a CUDA graph by hand (bit-equal to the uncaptured step, and its time);
5. ``benchmarks/kernel_bench.py --variants unscale``: check+unscale bandwidth on 1e8 elements
   (fp32, fp16, bf16) against ``copy_`` and the device's peak, speed against torch's foreach op
   on 10,000 small tensors and on GPT-2 small's gradients, and the host time per tensor;
6. ``benchmarks/scaler_share.py``: the check+unscale's share of a Graph O1 fp16 step on the
   GPT-2-small shape (8x512 tokens), amp_graph's op and torch's;
7. ``benchmarks/kernel_sweep.py``: the kernel's build-time tuning knobs, each variant's
   bandwidth over ``cudaMemcpyAsync`` of the same bytes (the library keeps its defaults).

A benchmark killed at its limit gives the figures it wrote so far (cuda_graph_bench.py writes
its report row by row) and counts as a failure; a stage the budget never reaches shows the
earlier run's figures from the results JSON, marked with that run's date and device.
``--log-dir DIR`` keeps each command's whole output (the console gets its tail).

It rewrites BENCHMARKS.md's GPU table and writes every figure, with the device, torch and
commit, into ``benchmarks/results/gpu-check.json``. Without a GPU it stops at once with exit
status 2 and a message saying so; BENCHMARKS.md is left alone. A stage that fails is reported
as FAILED in the table and the exit status is 1.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS_MD = ROOT / "BENCHMARKS.md"
BEGIN, END = "<!-- gpu-check:begin -->", "<!-- gpu-check:end -->"
NOT_MEASURED = "not yet measured (no GPU lent)"
NO_FIGURE = ("not yet measured", "not measured")  # cells that hold no measurement
GPU_SKIP_REASONS = ("needs a cuda", "needs a gpu")  # tests/conftest.py marks these `cuda`
FIGURES = [  # (key, what, target)
    ("tests", "CUDA tests (`pytest -m cuda`)", "all pass, none skipped"),
    (
        "compile_modes",
        "`amp_graph.compile(mode=...)` and `Graph` (as it comes, and with `enable_compile`), "
        "O1 bf16, / eager autocast loop (`*` = each one's default): GPT 2x768, 8x512 tokens; "
        "first call of compile's default",
        "default <= 1.0x",
    ),
    (
        "fp8_cost",
        "the per-GEMM fp8 cost model (`fp8_cost_model.py`): its figures, and at GPT-2's and a "
        "Llama stack's shapes the predicted / measured fp8 time over bf16's, decisions right",
        "every decision right",
    ),
    (
        "mfu",
        "GPT-2 small (124M, vocabulary 50257 in a head of 50304 rows as llm.c's, 1024 tokens), "
        "Graph O1 bf16 with "
        "`enable_compile()` and `enable_cuda_graph`: share of bf16 peak at the smallest batch "
        "that reaches it (`mfu.py`)",
        ">= 40%",
    ),
    (
        "fp8_step",
        "fp8 step (`fp8_step.py`), Llama stack 4x4096 (SwiGLU 14336), 8x2048 tokens, inductor: "
        "amp_graph's fp8 tensorwise / the bf16 `torch.compile` + autocast step; torchao float8",
        ">= 1.2x bf16, >= torchao",
    ),
    (
        "fp8_loss",
        "loss after 200 steps (a 4x1024 stack, bigram data, eager): fp8 against bf16's noise",
        "within bf16's noise",
    ),
    (
        "bandwidth",
        "check+unscale, 1 tensor of 1e8 fp32: GB/s, % of peak, / `copy_`",
        ">= 0.95x copy_",
    ),
    ("bandwidth_fp16", "the same in fp16: GB/s, / `copy_` of the same bytes", ">= 0.95x copy_"),
    ("bandwidth_bf16", "the same in bf16: GB/s, / `copy_` of the same bytes", ">= 0.95x copy_"),
    (
        "copy",
        "`copy_` of the 1e8 fp32 bytes: GB/s, % of peak (the practical ceiling); torch's "
        "in-place `mul_` of them (an in-place kernel's)",
        "-",
    ),
    ("small", "unscale, 10,000 tensors of 1e3 fp32 vs torch's foreach op", ">= 1.5x"),
    ("medium", "unscale, 10,000 tensors of 1e4 fp32 vs torch's foreach op", ">= 1.5x"),
    ("host", "host time per tensor of one call, 10,000 x 1e3 fp32: ours vs torch's", "-"),
    ("gpt2_fp32", "unscale, GPT-2 small's 148 gradients fp32 vs torch's foreach op", ">= 1.3x"),
    ("gpt2_fp16", "the same in fp16", ">= 1.3x"),
    ("syncs", "host syncs per Graph step (fp16 O1, fused AdamW)", "0"),
    ("captured", "Graph step captured in a CUDA graph: bit-equal to uncaptured", "yes"),
    ("captured_time", "captured step vs uncaptured step (median ms)", "-"),
    (
        "step_capture",
        "Graph O1 `enable_cuda_graph`, GPT 12x768, 8x512 tokens, / hand-written eager autocast "
        "loop: bf16; fp16",
        "<= 0.45x",
    ),
    (
        "step_capture_compile",
        'the same / `torch.compile(mode="reduce-overhead")` + fused AdamW loop (bf16)',
        "<= 0.90x",
    ),
    (
        "step_capture_inductor",
        "Graph O1 with `enable_compile()` and `enable_cuda_graph` (inductor's kernels, the whole "
        'step captured), 8x512 bf16: / `torch.compile(mode="reduce-overhead")` loop; / hand loop',
        "<= 0.90x",
    ),
    ("step_capture_64", "the same at 64x512 tokens / hand loop: bf16; fp16", "<= 0.95x"),
    (
        "step_capture_user_loop",
        "the user's own loop (8x512, bf16), / hand loop: `amp_graph.compile(mode='cudagraphs')`; "
        'the same uncaptured; the amp_graph backend with mode="reduce-overhead"',
        "-",
    ),
    (
        "step_capture_memory",
        "captured step's peak / uncaptured Graph step's (8x512, bf16); the first five calls' "
        "reserved peak, the warm-ups' cached blocks included",
        "<= 1.10x",
    ),
    (
        "step_capture_set_to_none",
        "`enable_cuda_graph(True, set_to_none=True)` (gradients set to None, each graph its "
        "own) / zeroed in place, 8x512 bf16: step time; step peak; first five calls' reserved "
        "peak",
        "< 1.00x",
    ),
    ("share", "check+unscale's share of a Graph O1 fp16 step, GPT 12x768, 8x512 tokens", "-"),
    ("sweep", "kernel knobs (`kernel_sweep.py`), 1e8 fp32: default / best variant, / memcpy", "-"),
    (
        "recompute",
        "`recompute_casts`: the measured threshold, what auto decides on GPT 12x768 (8x512, "
        "bf16, O1), and the step / torch.autocast with auto, every cast, none",
        "auto within 0.01 of the faster",
    ),
]
RESULTS_JSON = ROOT / "benchmarks" / "results" / "gpu-check.json"


class GpuCheckError(RuntimeError):
    """A stage could not produce its figures."""


@dataclasses.dataclass
class Results:
    """Figures by key (see FIGURES), as table cells; missing keys are not measured."""

    cells: dict[str, str] = dataclasses.field(default_factory=dict)
    failures: list[str] = dataclasses.field(default_factory=list)
    header: str = ""
    raw: dict[str, object] = dataclasses.field(default_factory=dict)  # the stages' own reports


# ---- the table --------------------------------------------------------------------------------


def render(results: Results) -> str:
    """The GPU section of BENCHMARKS.md (between the markers) for ``results``."""
    lines = [results.header or f"GPU figures: {NOT_MEASURED}. Run `make gpu-check` on a GPU.", ""]
    lines += ["| figure | target | measured |", "|---|---|---|"]
    for key, what, target in FIGURES:
        lines.append(f"| {what} | {target} | {results.cells.get(key, NOT_MEASURED)} |")
    if results.failures:
        lines += ["", "Failures:", *(f"* {failure}" for failure in results.failures)]
    return "\n".join(lines)


def replace_section(text: str, section: str) -> str:
    """``text`` with what lies between the gpu-check markers replaced by ``section``."""
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.DOTALL)
    if len(pattern.findall(text)) != 1:
        raise GpuCheckError(f"BENCHMARKS.md must hold exactly one {BEGIN} ... {END} section")
    return pattern.sub(lambda _: f"{BEGIN}\n{section}\n{END}", text)


# ---- stages -----------------------------------------------------------------------------------


def preflight() -> list[str]:
    """What keeps this machine from running the check (empty: nothing)."""
    import torch

    problems = []
    if not torch.cuda.is_available():
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
        problems.append(
            f"no CUDA GPU: torch.cuda.is_available() is False (torch {torch.__version__}, "
            f"{built}). Run `make gpu-check` on a machine with an NVIDIA GPU."
        )
        return problems
    try:
        import amp_graph.passes  # noqa: F401  (installed, with its passes package)
        import pytest  # noqa: F401
    except ImportError as error:
        problems.append(
            f"{error}: install the project into {sys.executable} (`make install`, or offline "
            f"`{sys.executable} -m pip install --no-deps --no-build-isolation -e .`)"
        )
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        problems.append("no CUDA toolkit (nvcc, CUDA_HOME): the amp_graph kernel cannot be built")
    if not cpp_extension.is_ninja_available():
        problems.append("ninja is missing (`pip install ninja`): the kernel cannot be built")
    return problems


TIMED_OUT = -9  # the exit status _run reports for a command killed at its limit
LOG_DIR: list[Path] = []  # where _run keeps each command's whole output (--log-dir), if set


def _run(command: list[str], seconds: float) -> subprocess.CompletedProcess:
    """Runs ``command`` for at most ``seconds``; a command past its limit is killed and comes
    back with exit status ``TIMED_OUT`` and what it had printed (its report, if it writes one
    as it goes, is read all the same)."""
    print("$", " ".join(command), flush=True)
    # its own process group, killed whole at its end: pytest-xdist's workers and inductor's
    # compile workers must not live on into the next stage and share its GPU or its cores;
    # output to files, not pipes, which a stray child would hold open
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(
            command, cwd=ROOT, stdout=out, stderr=err, text=True, start_new_session=True
        )
        try:
            returncode = process.wait(timeout=max(seconds, 1))
        except subprocess.TimeoutExpired:
            returncode = TIMED_OUT
        finally:
            _kill_group(process)
            process.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if returncode == TIMED_OUT:
        stderr += f"\n[gpu_check: killed at its {seconds:.0f} s limit]"
    done = subprocess.CompletedProcess(command, returncode, stdout, stderr)
    print(done.stdout[-6000:], done.stderr[-3000:], sep="\n", flush=True)
    for folder in LOG_DIR:  # the whole output, where the tail above cuts it
        folder.mkdir(parents=True, exist_ok=True)
        name = next((Path(a).stem for a in command if a.endswith(".py")), command[-1])
        name = "pytest" if "pytest" in command else name
        (folder / f"{name}.log").write_text(f"$ {' '.join(command)}\n{done.stdout}\n{done.stderr}")
    return done


def _kill_group(process: subprocess.Popen) -> None:
    """Kills every process of ``process``'s group (its own session, so never gpu_check)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone
        os.killpg(process.pid, signal.SIGKILL)


def gpu_skipped(suite: ElementTree.Element) -> int:
    """Skipped tests of a junit report whose reason is a missing GPU (the ones
    tests/conftest.py marks ``cuda``): on a GPU machine, none may skip."""
    reasons = [s.get("message", "") for s in suite.iter("skipped")]
    return sum(r.lower().removeprefix("skipped: ").startswith(GPU_SKIP_REASONS) for r in reasons)


TEST_WORKERS = 4  # pytest-xdist processes sharing the one GPU (the GPU machines have 16 cores)


def cuda_tests_command(report: Path, workers: int) -> list[str]:
    """The CUDA tests' pytest command, writing its JUnit report to ``report``. With ``workers``
    above 1 (and pytest-xdist installed) the files run in that many processes sharing the GPU:
    the tests check results, not times, and the ones that compile (inductor, nvcc) are bound
    by the CPU, of which a GPU machine has 16 cores and one process uses one."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"]
    command += [f"--junitxml={report}", "-m", "cuda", "--durations=15"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        command.append("--timeout=150")  # a hung capture fails its test, not the stage
    if workers > 1 and importlib.util.find_spec("xdist") is not None:
        # loadfile: a file's tests in one process, in order, as `make test` runs them
        command += ["-n", str(workers), "--dist", "loadfile"]
    return command


def junit_suite(report: Path) -> ElementTree.Element:
    """The test suite of pytest's JUnit report (``<testsuites>`` around it or not)."""
    root = ElementTree.parse(report).getroot()
    return root if root.tag == "testsuite" else root.find("testsuite")


def run_tests(seconds: float, results: Results) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        done = _run(cuda_tests_command(report, TEST_WORKERS), seconds)
        if done.returncode == TIMED_OUT:
            raise GpuCheckError(f"the CUDA tests ran past their {seconds:.0f} s")
        if not report.exists():
            raise GpuCheckError(f"pytest wrote no report (exit status {done.returncode})")
        suite = junit_suite(report)
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        gpu_skips = gpu_skipped(suite)
    # a module that skips as a whole (an optional extra missing) reports a skip even under -m
    # cuda; only a CUDA test that skipped on this GPU machine counts against the check
    other_skips = counts["skipped"] - gpu_skips
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    cell = f"{passed} passed, {counts['failures'] + counts['errors']} failed, "
    results.cells["tests"] = (
        cell
        + f"{gpu_skips} skipped"
        + (f" (and {other_skips} modules outside the CUDA tests)" if other_skips else "")
    )
    if done.returncode != 0 or gpu_skips or passed == 0:
        raise GpuCheckError(f"CUDA tests: {results.cells['tests']} (exit {done.returncode})")


def _script_report(
    script: str, args: list[str], seconds: float, results: Results, *, any_exit: bool = False
) -> tuple[subprocess.CompletedProcess, object]:
    """Runs ``benchmarks/<script> <args> --json <file>`` and returns it with the report it wrote.
    A missing report fails the stage, and so does a nonzero exit unless ``any_exit``; a script
    killed at its limit whose report exists (one written as it goes) gives its figures so far,
    and the check records the timeout as a failure."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        done = _run([sys.executable, f"benchmarks/{script}", *args, "--json", str(out)], seconds)
        if done.returncode == TIMED_OUT:
            if not out.exists():
                raise GpuCheckError(f"{script} ran past its {seconds:.0f} s, with no figures")
            results.failures.append(
                f"{script} ran past its {seconds:.0f} s: its figures are those it had"
            )
        elif (done.returncode != 0 and not any_exit) or not out.exists():
            raise GpuCheckError(f"{script} failed (exit {done.returncode})")
        return done, json.loads(out.read_text())


def run_kernel_bench(seconds: float, results: Results) -> None:
    args = ["--device", "cuda", "--variants", "unscale"]
    _, report = _script_report("kernel_bench.py", args, seconds, results)
    meta, rows = report["meta"], report["rows"]
    if meta["extension"] != "loaded":
        raise GpuCheckError(f"the CUDA extension is {meta['extension']}: no kernel was measured")
    results.raw["kernel_bench"] = report
    by = {(r["case"], r["dtype"], r["variant"]): r for r in rows}
    peak = meta["peak_gbps"]

    def pct(gbps: float) -> str:
        return "" if peak is None else f", {100 * gbps / peak:.0f}% of {peak:.0f} GB/s"

    def row(case: str, dtype: str) -> dict | None:
        return by.get((case, dtype, "unscale"))

    def in_place(r: dict) -> str:
        """Ours against torch's in-place mul_ of the same bytes (reports since 2026-12-06)."""
        gbps = r.get("inplace_gbps")
        return f"; {r['ours_gbps'] / gbps:.2f}x an in-place mul_ ({gbps:.0f} GB/s)" if gbps else ""

    for key, dtype in (
        ("bandwidth", "fp32"),
        ("bandwidth_fp16", "fp16"),
        ("bandwidth_bf16", "bf16"),
    ):
        big = row("1x1e8", dtype)
        if big is not None:
            extra = pct(big["ours_gbps"]) if dtype == "fp32" else ""
            results.cells[key] = (
                f"{big['ours_gbps']:.0f} GB/s{extra}; "
                f"{big['ours_gbps'] / big['copy_gbps']:.2f}x copy_ ({big['copy_gbps']:.0f} GB/s)"
                + in_place(big)
            )
    big = row("1x1e8", "fp32")
    if big is not None:
        results.cells["copy"] = f"{big['copy_gbps']:.0f} GB/s{pct(big['copy_gbps'])}"
        if big.get("inplace_gbps"):  # the in-place ceiling, against the copy's
            results.cells["copy"] += (
                f"; an in-place mul_ {big['inplace_gbps']:.0f} GB/s, "
                f"{big['inplace_gbps'] / big['copy_gbps']:.2f}x copy_"
            )
    for key, case, dtype in (
        ("small", "10000x1e3", "fp32"),
        ("medium", "10000x1e4", "fp32"),
        ("gpt2_fp32", "gpt2_mix", "fp32"),
        ("gpt2_fp16", "gpt2_mix", "fp16"),
    ):
        r = row(case, dtype)
        if r is not None:
            results.cells[key] = (
                f"{r['speedup_vs_torch']:.2f}x ({r['ours_ms']:.3f} ms vs {r['torch_ms']:.3f} ms)"
            )
    small = row("10000x1e3", "fp32")
    if small is not None and "ours_host_ns_per_tensor" in small:
        ours, theirs = small["ours_host_ns_per_tensor"], small["torch_host_ns_per_tensor"]
        results.cells["host"] = f"{ours:.0f} ns vs {theirs:.0f} ns"
    results.header += f" Peak bandwidth from {meta['peak_source']}."


def run_graph_step(seconds: float, results: Results) -> None:
    _, step = _script_report("graph_step_cuda.py", [], seconds, results)
    results.raw["graph_step"] = step
    results.cells["syncs"] = f"{step['syncs_per_step']:g}"
    results.cells["captured"] = "yes" if step["bit_equal"] else "**no**"
    results.cells["captured_time"] = (
        f"{step['captured_ms']:.3f} ms vs {step['eager_ms']:.3f} ms ({step['speedup']:.2f}x)"
    )


def run_step_capture(seconds: float, results: Results) -> None:
    args = ["--batch", "8", "64", "--dtype", "bf16", "fp16", "--compile-dtype", "bf16"]
    args += ["--compile-batch", "8", "--graph-compile", "--repeats", "10"]
    _, rows = _script_report("cuda_graph_bench.py", args, seconds, results, any_exit=True)
    results.raw["step_capture"] = rows
    captured, hand, compiled = "Graph O1 cuda_graph", "hand", "torch.compile reduce-overhead"
    by = {(r["setup"].split(", ")[-1].split(" ")[0], r["dtype"]): r for r in rows}
    broken = [
        f"{r['setup']} {r['dtype']}, {name}: {cell['error']}"
        for r in rows
        for name, cell in r.items()
        if isinstance(cell, dict) and "error" in cell
    ]

    def timed(row: dict | None, name: str) -> dict | None:
        cell = None if row is None else row.get(name)
        return cell if isinstance(cell, dict) and "ms" in cell else None

    for key, batch in (("step_capture", "8x512"), ("step_capture_64", "64x512")):
        cells = []
        for d in ("bfloat16", "float16"):
            row = by.get((batch, d))
            mine, theirs = timed(row, captured), timed(row, hand)
            if mine is not None and theirs is not None:
                cells.append(
                    f"{mine['vs_hand']:.3f}x ({mine['ms']:.2f} ms vs {theirs['ms']:.2f} ms)"
                )
            elif row is not None:
                cells.append(f"{d}: failed")
        if cells:
            results.cells[key] = "; ".join(cells)
    row = by.get(("8x512", "bfloat16"))
    if row is not None and "captured_vs_compile" in row and timed(row, compiled):
        results.cells["step_capture_compile"] = (
            f"{row['captured_vs_compile']:.3f}x ({row[compiled]['ms']:.2f} ms)"
        )
    inductor = timed(row, "Graph O1 enable_compile cuda_graph")
    if inductor is not None and "compiled_captured_vs_compile" in row:
        results.cells["step_capture_inductor"] = (
            f"{row['compiled_captured_vs_compile']:.3f}x; {inductor['vs_hand']:.3f}x "
            f"({inductor['ms']:.2f} ms)"
        )
    loops = ("compile O1 cuda_graph", "compile O1", "amp_graph backend reduce-overhead")
    if row is not None and any(name in row for name in loops):
        results.cells["step_capture_user_loop"] = "; ".join(
            f"{cell['vs_hand']:.3f}x" if (cell := timed(row, name)) else "failed" for name in loops
        )
    mine, base = timed(row, captured), timed(row, "Graph O1")
    if mine is not None and base is not None and mine["peak_step_mb"] and base["peak_step_mb"]:
        peak, base_mb = mine["peak_step_mb"], base["peak_step_mb"]
        states = (mine.get("pool") or {}).get("mib_by_state", {})
        split = (
            f"; pool {states.get('active_allocated', 0):.0f} MB live, "
            f"{states.get('inactive', 0):.0f} MB free"
            if states
            else ""
        )
        first, base_first = mine.get("first_calls_reserved_mb"), base.get("first_calls_reserved_mb")
        results.cells["step_capture_memory"] = (
            f"{peak / base_mb:.2f}x ({peak:.0f} / {base_mb:.0f} MB{split})"
            + (
                f"; the first five calls (warm-ups and the capture) reserve "
                f"{first / base_first:.2f}x ({first:.0f} / {base_first:.0f} MB)"
                if first and base_first
                else ""
            )
        )
    to_none = timed(row, "Graph O1 cuda_graph set_to_none")
    if mine is not None and to_none is not None and "set_to_none_vs_in_place" in row:
        results.cells["step_capture_set_to_none"] = _set_to_none_cell(
            row["set_to_none_vs_in_place"], to_none, mine
        )
    if broken:
        raise GpuCheckError("cuda_graph_bench.py: " + "; ".join(broken))


def _set_to_none_cell(time_ratio: float, to_none: dict, in_place: dict) -> str:
    """``set_to_none=True``'s row against the default's (gradients zeroed in place), from
    cuda_graph_bench.py's cells of one run: time (the median of per-round ratios), step peak,
    first calls' reserved peak."""
    parts = [f"{time_ratio:.3f}x ({to_none['ms']:.2f} / {in_place['ms']:.2f} ms)"]
    for key in ("peak_step_mb", "first_calls_reserved_mb"):
        ours, theirs = to_none.get(key), in_place.get(key)
        parts.append(
            f"{ours / theirs:.2f}x ({ours:.0f} / {theirs:.0f} MB)" if ours and theirs else "-"
        )
    return "; ".join(parts)


def run_scaler_share(seconds: float, results: Results) -> None:
    _, share = _script_report("scaler_share.py", [], seconds, results)
    results.raw["scaler_share"] = share
    results.cells["share"] = (
        f"amp_graph {share['ours_ms']:.3f} ms ({100 * share['ours_share']:.2f}%), torch's op "
        f"{share['torch_ms']:.3f} ms ({100 * share['torch_share']:.2f}%) of a "
        f"{share['step_ms']:.2f} ms step"
    )


def run_kernel_sweep(seconds: float, results: Results) -> None:
    # its exit status says whether every variant was exact: its rows are reported either way
    done, rows = _script_report("kernel_sweep.py", [], seconds, results, any_exit=True)
    results.raw["kernel_sweep"] = rows
    big = [r for r in rows if r["case"] == "1x1e8" and r["dtype"] == "fp32"]
    base = next(r for r in big if r["variant"] == "base")
    best = max(big, key=lambda r: r["gbps"] / r["copy_gbps"])
    results.cells["sweep"] = (
        f"{base['gbps'] / base['copy_gbps']:.2f}x / {best['gbps'] / best['copy_gbps']:.2f}x "
        f"({best['variant']})"
    )
    if done.returncode != 0:
        raise GpuCheckError("kernel_sweep.py: a variant gave inexact results")


def run_compile_modes(seconds: float, results: Results) -> None:
    # the GPT alone, 2 layers, and only the default's first call cold: five inductor compiles
    # (torch's two modes, ours two, the Graph's), the others reusing the default's kernels
    args = ["--device", "cuda", "--models", "gpt", "--layers", "2", "--repeats", "10"]
    args += ["--cold", "default"]
    _, report = _script_report("compile_modes.py", args, seconds, results)
    results.raw["compile_modes"] = report
    cells = []
    for model in report["results"]:
        rows = model["rows"]
        failed = [f"{name}: {row['error']}" for name, row in rows.items() if "error" in row]
        results.failures += [f"compile_modes.py, {model['model']}, {line}" for line in failed]
        rows = {name: row for name, row in rows.items() if "error" not in row}
        if not any("vs_autocast_eager" in row for row in rows.values()):  # cut short
            firsts = ", ".join(
                f"{name} {row['first_call_s']:.0f} s"
                + ("" if row.get("first_call_warm") else " cold")
                for name, row in rows.items()
            )
            cut = "cut short before the timed rounds; first calls"
            cells.append(f"{model['model']}: {cut} {firsts}")
            continue
        ratios = ", ".join(
            f"{name.removeprefix('compile ')}{'*' if row['default'] else ''} "
            f"{row['vs_autocast_eager']:.3f}"
            for name, row in rows.items()
            if name.startswith("compile ")
        )
        torch_rows = ", ".join(
            f"{name.removesuffix(' + autocast')} {row['vs_autocast_eager']:.3f}"
            for name, row in rows.items()
            if name.startswith("torch.compile")
        )
        # the Graph as it comes (*) and compiled: whether its default should follow compile's
        graph_rows = "".join(
            f"; {name}{'*' if row['default'] else ''} {row['vs_autocast_eager']:.3f}"
            for name, row in rows.items()
            if name.startswith("Graph")
        )
        first = next(
            (
                f"{row['first_call_s']:.0f} s"
                for name, row in rows.items()
                if row["default"] and name.startswith("compile ")
            ),
            "failed",
        )
        errors = f"; failed: {', '.join(line.split(':')[0] for line in failed)}" if failed else ""
        cells.append(
            f"{model['model']}: {ratios}; {torch_rows}{graph_rows}; first call {first}{errors}"
        )
    results.cells["compile_modes"] = "; ".join(cells)


def run_fp8_cost(seconds: float, results: Results) -> None:
    _, report = _script_report("fp8_cost_model.py", ["--device", "cuda"], seconds, results)
    results.raw["fp8_cost"] = report
    rows = "; ".join(
        f"{'x'.join(map(str, row['shape']))} {row['predicted']:.2f}/{row['measured']:.2f}"
        f"{'' if row['right'] else ' WRONG'}"
        for row in report["rows"]
    )
    right = sum(row["right"] for row in report["rows"])
    results.cells["fp8_cost"] = (
        f"{report['model']}; {rows}; {right} of {len(report['rows'])} decisions right"
    )


def run_mfu(seconds: float, results: Results) -> None:
    # from 16 sequences up: each batch is one inductor compile of GPT-2 small's step
    args = ["--device", "cuda", "--batches", "16", "32", "64", "--repeats", "10"]
    _, report = _script_report("mfu.py", args, seconds, results, any_exit=True)
    results.raw["mfu"] = report
    measured = [row for row in report["rows"] if "error" not in row]
    ours = [row for row in measured if row["variant"] == "Graph O1 compile cuda_graph"]
    if not ours:
        errors = "; ".join(row["error"] for row in report["rows"] if "error" in row)
        raise GpuCheckError(f"mfu.py measured no step ({errors or 'no rows'})")
    key = "mfu_spec" if report["peak_tflops"]["spec"] is not None else "mfu_matmul"
    best = report.get("at_target") or max(ours, key=lambda row: row[key])
    peak = report["peak_tflops"]
    spec = "" if peak["spec"] is None else f"{best['mfu_spec']:.1%} of {peak['spec']:.0f}, "
    results.cells["mfu"] = (
        f"{'' if report.get('at_target') else 'best (none reached the target): '}"
        f"{best['batch']}x1024: {spec}{best['mfu_matmul']:.1%} of the measured matmul's "
        f"{peak['matmul']:.0f} TFLOP/s ({best['tflops']:.0f} TFLOP/s, {best['ms']:.1f} ms, "
        f"{best['step_tflop']:.2f} TFLOP a step); batches measured "
        + ", ".join(f"{row['batch']} {row[key]:.1%}" for row in ours)
    )


def run_fp8_step(seconds: float, results: Results) -> None:
    # three inductor compiles of the Llama stack (bf16, ours, torchao's), then the loss check
    variants = ["bf16 torch.compile", "fp8 amp_graph tensorwise", "fp8 torchao tensorwise"]
    args = ["--device", "cuda", "--repeats", "10", "--variants", *variants]
    _, report = _script_report("fp8_step.py", args, seconds, results, any_exit=True)
    results.raw["fp8_step"] = report
    steps = report["steps"]
    base, ours, torchao = (steps.get(v, {}) for v in variants)
    # interleaved medians; a run cut short before them has each variant timed alone
    timed = "ms" if "ms" in base and "ms" in ours else "solo_ms"
    if timed not in base or timed not in ours:
        errors = "; ".join(f"{v}: {row['error']}" for v, row in steps.items() if "error" in row)
        raise GpuCheckError(f"fp8_step.py measured no fp8 against bf16 ({errors})")
    rates = f", {ours['tflops']:.0f} vs {base['tflops']:.0f} TFLOP/s" if timed == "ms" else ""
    cell = (
        f"ours {base[timed] / ours[timed]:.2f}x bf16 ({ours[timed]:.1f} ms vs "
        f"{base[timed]:.1f} ms{rates})"
    )
    if timed in torchao:
        cell += (
            f"; torchao {base[timed] / torchao[timed]:.2f}x bf16; ours / torchao's step "
            f"{torchao[timed] / ours[timed]:.2f}x"
        )
    else:
        cell += f"; torchao not measured ({torchao.get('error', 'not run')[:80]})"
    if timed == "solo_ms":
        cell += " (each timed alone after its compile: the interleaved rounds did not run)"
    results.cells["fp8_step"] = cell
    loss = report.get("loss")
    if loss is None or "within" not in loss:
        missing = "cut short" if loss is None else "; ".join(loss["errors"].values())[:120]
        results.cells["fp8_loss"] = f"not measured ({missing})"
        return
    runs = ", ".join(
        f"{name.removeprefix('fp8 ')} {loss['final'][name]:.4f}{'' if ok else ' OUTSIDE'}"
        for name, ok in loss["within"].items()
    )
    results.cells["fp8_loss"] = (
        f"after {loss['steps']} steps: bf16 {loss['final']['bf16']:.4f} "
        f"(noise {loss['allowed']:.4f}); {runs}"
    )


def run_recompute(seconds: float, results: Results) -> None:
    args = ["--device", "cuda", "--gpt2", "--repeats", "9"]
    _, report = _script_report("eager_step.py", args, seconds, results)
    results.raw["recompute"] = report
    [step] = report["steps"]
    ratios, decided = step["ratios"], step["decided"]
    threshold = report["cost"]["min_copy_bytes"] / 2**20
    results.cells["recompute"] = (
        f"copies below {threshold:.1f} MiB kept; auto: {decided['O1, auto']}; "
        f"{ratios['O1, auto']:.3f} / {ratios['O1, every cast']:.3f} / {ratios['O1, none']:.3f}"
    )


Stage = Callable[[float, Results], None]  # (its seconds, the results it fills in)
# The listed order is the order among stages whose figures are equally old: stage_order runs
# first those an earlier run has not measured, so that a budget cut short costs the figures
# an earlier run already has.
STAGES: list[tuple[Stage, float]] = [
    (run_tests, 240.0),
    (run_compile_modes, 150.0),  # 5 inductor compiles of a 2-layer GPT
    (run_fp8_cost, 50.0),
    (run_mfu, 150.0),
    (run_fp8_step, 200.0),
    (run_step_capture, 200.0),
    (run_recompute, 120.0),
    (run_graph_step, 60.0),
    (run_kernel_bench, 100.0),
    (run_scaler_share, 80.0),
    (run_kernel_sweep, 120.0),
]
STAGE_FIGURES = {  # which figures each stage gives (an earlier run's stand in if it never ran)
    run_tests: ("tests",),
    run_compile_modes: ("compile_modes",),
    run_fp8_cost: ("fp8_cost",),
    run_mfu: ("mfu",),
    run_fp8_step: ("fp8_step", "fp8_loss"),
    run_step_capture: (
        "step_capture",
        "step_capture_compile",
        "step_capture_inductor",
        "step_capture_64",
        "step_capture_user_loop",
        "step_capture_memory",
        "step_capture_set_to_none",
    ),
    run_recompute: ("recompute",),
    run_graph_step: ("syncs", "captured", "captured_time"),
    run_kernel_bench: (
        "bandwidth",
        "bandwidth_fp16",
        "bandwidth_bf16",
        "copy",
        "small",
        "medium",
        "host",
        "gpt2_fp32",
        "gpt2_fp16",
    ),
    run_scaler_share: ("share",),
    run_kernel_sweep: ("sweep",),
}


def earlier_figures(path: Path, keys: tuple[str, ...]) -> dict[str, str]:
    """The cells ``keys`` had in the results JSON at ``path`` (an earlier run), each saying
    when and on which device it was measured; empty where there is none."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    when = f" (earlier run: {record.get('date')}, {record.get('device')})"
    figures = record.get("figures") or {}
    return {
        key: figures[key] if EARLIER.search(figures[key]) else figures[key] + when
        for key in keys
        if figures.get(key) and not figures[key].startswith(NO_FIGURE)
    }


EARLIER = re.compile(r"\(earlier run: (\d{4}-\d\d-\d\d)")


def measured_on(path: Path, keys: tuple[str, ...]) -> str:
    """The date of the oldest of the figures ``keys`` in the results JSON at ``path``: the run
    that wrote it, or the earlier run a stand-in names; ``""`` if any was never measured."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return ""
    figures = record.get("figures") or {}
    dates = []
    for key in keys:
        cell = figures.get(key)
        if not cell or cell.startswith(NO_FIGURE):
            return ""
        earlier = EARLIER.search(cell)
        dates.append(earlier.group(1) if earlier else str(record.get("date", "")))
    return min(dates)


OUT_OF_TIME = "out of time before this stage"


def completed_seconds(path: Path) -> dict[str, float]:
    """Each stage's seconds in the last run that completed it, from the results JSON at
    ``path`` (a stage that failed, was cut short or never ran has none)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    failed = {  # a stage not started for want of time keeps the seconds carried for it
        failure.split(":", 1)[0]
        for failure in record.get("failures") or []
        if OUT_OF_TIME not in failure
    }
    seconds = record.get("stage_seconds") or {}
    return {name: float(t) for name, t in seconds.items() if name not in failed}


def seconds_needed(limit: float, completed_in: float | None) -> float:
    """The time left that a stage limited to ``limit`` seconds is started with: what it took
    when it last completed, with a margin (it would not finish in less, so the time goes to
    the stages after it), or, never completed, half its limit (it writes its figures as it
    goes, so a stage cut short still gives some)."""
    if completed_in is None:
        return max(10.0, limit / 2)
    return max(10.0, min(limit, 1.2 * completed_in + 5.0))


def stage_order(path: Path) -> list[tuple[Stage, float]]:
    """The tests first, then the stages by the age of their figures in the results JSON at
    ``path``, never measured first (in STAGES' order among equals): a budget that cannot hold
    every stage measures next time what it left out this time."""
    tests, *benchmarks = STAGES
    return [tests, *sorted(benchmarks, key=lambda st: measured_on(path, STAGE_FIGURES[st[0]]))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=460.0, help="seconds for all stages")
    parser.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    parser.add_argument("--benchmarks-md", type=Path, default=BENCHMARKS_MD)
    parser.add_argument(
        "--results-json", type=Path, default=RESULTS_JSON, help="every figure, machine-readable"
    )
    parser.add_argument(
        "--log-dir", type=Path, default=None, help="keep each stage's whole output here"
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=[stage.__name__.removeprefix("run_") for stage, _ in STAGES],
        help="run these stages alone (the others keep an earlier run's figures)",
    )
    args = parser.parse_args(argv)
    LOG_DIR[:] = [args.log_dir] if args.log_dir else []

    problems = preflight()
    if problems:
        print("\n".join(["", "=" * 78, "GPU CHECK NOT RUN:", *problems, "=" * 78]), file=sys.stderr)
        return 2
    import torch

    results = Results()
    results.header = (
        f"Measured {datetime.date.today()} by `make gpu-check` on {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}."
    )
    deadline = time.monotonic() + args.budget
    completed = completed_seconds(args.results_json)
    took: dict[str, float] = {}
    for stage, seconds in stage_order(args.results_json):
        if args.only and stage.__name__.removeprefix("run_") not in args.only:
            results.cells |= earlier_figures(args.results_json, STAGE_FIGURES[stage])
            continue
        left = deadline - time.monotonic()
        start = time.monotonic()
        try:
            if left < seconds_needed(seconds, completed.get(stage.__name__)):
                raise GpuCheckError(f"{OUT_OF_TIME} ({left:.0f} s left)")
            stage(min(seconds, left), results)
            took[stage.__name__] = round(time.monotonic() - start, 1)
        except Exception as error:  # a stage's fault must not cost the other stages' figures
            kind = "" if isinstance(error, GpuCheckError) else f"{type(error).__name__}: "
            results.failures.append(f"{stage.__name__}: {kind}{error}")
            earlier = earlier_figures(args.results_json, STAGE_FIGURES[stage])
            results.cells |= {k: v for k, v in earlier.items() if k not in results.cells}
    # each stage's seconds when it last completed, to fit the stages into the budget next time
    results.raw["stage_seconds"] = completed | took
    section = render(results)
    print(section)
    if not args.no_write:
        path = args.benchmarks_md
        path.write_text(replace_section(path.read_text(), section))
        print(f"wrote the GPU table into {path}")
        write_results_json(
            args.results_json, results, torch.cuda.get_device_name(), torch.__version__
        )
        print(f"wrote every figure into {args.results_json}")
    return 1 if results.failures else 0


def write_results_json(path: Path, results: Results, device: str, torch_version: str) -> None:
    """Device, torch, commit, date, the table's cells, the failures and the stages' own reports
    (every row of kernel_bench.py, graph_step_cuda.py's figures), so that the numbers can be
    checked later."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout

    commit = git("rev-parse", "HEAD").strip()
    changed = [line[3:] for line in git("status", "--porcelain").splitlines()]
    record = {
        "device": device,
        "torch": torch_version,
        "commit": commit or None,
        # files that differed from the commit when measured (BENCHMARKS.md aside: rewritten here)
        "uncommitted": [path for path in changed if path != "BENCHMARKS.md"],
        "date": str(datetime.date.today()),
        "figures": {key: results.cells.get(key) for key, _, _ in FIGURES},
        "targets": {key: target for key, _, target in FIGURES},
        "failures": results.failures,
        **results.raw,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
