"""``make gpu-rehearsal``: every script ``make gpu-check`` runs, run on the CPU under the GPU
machine's torch (2.11 with torchao 0.17, in a venv of its own), before a GPU session spends its
minutes on them.

    python benchmarks/gpu_rehearsal.py            # what `make gpu-rehearsal` runs in that venv

A GPU session has 15 minutes of device time, and gpu-check's scripts run nowhere else on the
GPU machine's torch: an API that torch 2.11 or torchao 0.17 lacks, or a code path that only a
GPU takes, fails there and costs that stage's figures (on 2026-12-06, fp8_step.py's amp_graph
variant failed inductor's compile on 2.11 on the CPU; b9259da fixed it).

Each stage's script runs as :data:`CPU_RUNS` says: the stage's own arguments, on the CPU, at the
smallest size that runs its code; it passes if it exits 0 and writes its report (the figures
mean nothing here). The CUDA tests run as gpu-check runs them (``pytest -m cuda``): here they
skip but for those that need no GPU (the kernel's sources compiled with nvcc against this
torch's headers, and its host logic). What a rehearsal cannot show: the CUDA-only paths
(captures, kernels, CUDA events), and the scripts with no CPU path at all, which it names.
Nothing is measured and nothing is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import gpu_check


@dataclasses.dataclass(frozen=True)
class OnTheCpu:
    """How a stage's command runs on the CPU: its own arguments, ``--device cuda`` made
    ``--device cpu``, less ``drop``, then ``add`` (a later value of an option wins)."""

    add: tuple[str, ...]
    drop: tuple[str, ...] = ()

    def command(self, script: str, stage_args: list[str]) -> list[str]:
        args = [
            "cpu" if arg == "cuda" and i and stage_args[i - 1] == "--device" else arg
            for i, arg in enumerate(stage_args)
            if arg not in self.drop
        ]
        if "--device" not in args:
            args = ["--device", "cpu", *args]
        return [sys.executable, f"benchmarks/{script}", *args, *self.add]


# Each stage's script: how it runs on the CPU at the smallest size that runs its code, or why
# it cannot. tests/test_gpu_rehearsal.py checks that every script a stage runs is here.
CPU_RUNS: dict[str, OnTheCpu | str] = {
    "compile_modes.py": OnTheCpu(add=("--tiny", "--repeats", "2")),
    "fp8_cost_model.py": OnTheCpu(add=()),
    "mfu.py": OnTheCpu(add=("--tiny", "--batches", "1", "2", "--repeats", "2", "--compile")),
    "fp8_step.py": OnTheCpu(add=("--tiny", "--repeats", "2", "--loss-steps", "5")),
    "cuda_graph_bench.py": OnTheCpu(
        add=("--tiny", "--batch", "1", "--compile-batch", "1", "--repeats", "2")
    ),
    # GPT-2 small's step takes tens of seconds on a CPU: the script's CPU widths instead
    "eager_step.py": OnTheCpu(add=("--quick", "--no-held", "--repeats", "2"), drop=("--gpt2",)),
    "kernel_bench.py": OnTheCpu(add=("--reps", "2")),
    "graph_step_cuda.py": "CUDA only: host syncs and a hand-made capture of a CUDA step",
    "scaler_share.py": "CUDA only: the check+unscale's share of a CUDA step",
    "kernel_sweep.py": "CUDA only: it times the kernel's variants (its builds are rehearsed)",
}
# kernel_sweep.py's builds are checked all the same: nvcc for sm_90, against this torch
BUILDS = [sys.executable, "benchmarks/kernel_sweep.py", "--compile-only"]
SECONDS = 600.0  # each command's limit (the CPU is slower than the GPU machine)
TEST_WORKERS = 2  # this machine's cores


@dataclasses.dataclass(frozen=True)
class Rehearsal:
    name: str
    command: list[str] | None  # None: not rehearsed (see why_not); the tests build theirs
    why_not: str = ""
    writes_report: bool = True
    tests: bool = False  # the CUDA tests, as gpu-check runs them (rehearse_tests)


def rehearsals() -> list[Rehearsal]:
    """The CUDA tests, each stage's script (in STAGES' order) and kernel_sweep.py's builds."""
    runs = [Rehearsal("CUDA tests", None, writes_report=False, tests=True)]
    for stage, _ in gpu_check.STAGES[1:]:
        for script, stage_args in stage_scripts(stage):
            how = CPU_RUNS[script]
            if isinstance(how, str):
                runs.append(Rehearsal(script, None, how))
            else:
                runs.append(Rehearsal(script, how.command(script, stage_args)))
    runs.append(Rehearsal("kernel_sweep.py builds", BUILDS, writes_report=False))
    return runs


def stage_scripts(stage: gpu_check.Stage) -> list[tuple[str, list[str]]]:
    """The benchmark scripts ``stage`` runs, with their arguments: the stage is called with
    gpu_check's script runner replaced by one that records its first script and stops it
    (every stage runs one)."""
    seen: list[tuple[str, list[str]]] = []

    class Stop(Exception):
        pass

    def record(script: str, args: list[str], *rest: object, **kwargs: object) -> None:
        seen.append((script, list(args)))
        raise Stop

    original = gpu_check._script_report
    gpu_check._script_report = record  # type: ignore[assignment]
    try:
        stage(1.0, gpu_check.Results())
    except Stop:
        pass
    finally:
        gpu_check._script_report = original
    return seen


def rehearse_tests(seconds: float) -> str:
    """The CUDA tests as gpu-check runs them: '' if none failed, else what failed."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        done = gpu_check._run(gpu_check.cuda_tests_command(report, TEST_WORKERS), seconds)
        if not report.exists():
            return f"pytest wrote no report (exit status {done.returncode})"
        suite = gpu_check.junit_suite(report)
        failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        if failed or done.returncode != 0:
            return f"{failed} failed (exit status {done.returncode})"
        return ""


def rehearse(run: Rehearsal, seconds: float) -> str:
    """One command: '' if it exited 0 (with its report, where it writes one), else why not."""
    assert run.command is not None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        command = [*run.command, "--json", str(out)] if run.writes_report else run.command
        done = gpu_check._run(command, seconds)
        if done.returncode != 0:
            last = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:]
            return f"exit status {done.returncode}: {last[0][:200] if last else ''}"
        if run.writes_report:
            try:
                json.loads(out.read_text())
            except (OSError, ValueError) as error:
                return f"no report: {error}"
        return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=SECONDS, help="each command's limit")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep each command's output")
    args = parser.parse_args(argv)
    gpu_check.LOG_DIR[:] = [args.log_dir] if args.log_dir else []
    import torch

    versions = f"torch {torch.__version__}"
    try:
        import torchao

        versions += f", torchao {torchao.__version__}"
    except ImportError:
        versions += ", no torchao (fp8_step.py's reference fails)"
    print(f"gpu-check's scripts on the CPU under {versions}", flush=True)
    outcomes = []
    for run in rehearsals():
        start = time.monotonic()
        if run.command is None and not run.tests:
            outcomes.append((run.name, f"not rehearsed ({run.why_not})"))
            continue
        fault = rehearse_tests(args.seconds) if run.tests else rehearse(run, args.seconds)
        took = f"ran ({time.monotonic() - start:.0f} s)"
        outcomes.append((run.name, f"FAILED: {fault}" if fault else took))
    print(f"\n== gpu-check's scripts on the CPU under {versions}")
    for name, outcome in outcomes:
        print(f"  {name:24s} {outcome}")
    return 1 if any(outcome.startswith("FAILED") for _, outcome in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
