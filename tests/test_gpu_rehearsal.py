"""``make gpu-rehearsal`` (benchmarks/gpu_rehearsal.py): every script a gpu-check stage runs is
run on the CPU, with the stage's own arguments made CPU-sized, or named with why it cannot be;
a script that fails is reported and fails the rehearsal."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402
import gpu_rehearsal  # noqa: E402


def test_every_script_a_stage_runs_is_rehearsed_or_says_why_not() -> None:
    """A stage added to gpu-check without a CPU form fails here, not on the GPU machine."""
    scripts = []
    for stage, _ in gpu_check.STAGES[1:]:
        ran = gpu_rehearsal.stage_scripts(stage)
        assert ran, f"{stage.__name__} ran no benchmark script"
        scripts += [script for script, _ in ran]
    assert set(scripts) == set(gpu_rehearsal.CPU_RUNS)  # none missing, none left over
    assert all(Path(ROOT, "benchmarks", script).exists() for script in scripts)


def test_each_rehearsal_is_the_stages_command_on_the_cpu() -> None:
    runs = {run.name: run for run in gpu_rehearsal.rehearsals()}
    for run in runs.values():
        if not run.command:
            continue
        args = run.command[2:]
        assert "cuda" not in args, run.command
        if "--device" in args:
            assert args[len(args) - 1 - args[::-1].index("--device") + 1] == "cpu"
    # the stage's own choices stay (fp8_step's three variants), its sizes give way to the CPU's
    fp8 = runs["fp8_step.py"].command
    assert (
        fp8 is not None and "fp8 torchao tensorwise" in fp8 and "fp8 amp_graph rowwise" not in fp8
    )
    assert fp8[fp8.index("--tiny") :].count("--repeats") == 1
    eager = runs["eager_step.py"].command
    assert eager is not None and "--gpt2" not in eager
    assert runs["graph_step_cuda.py"].command is None
    assert "CUDA only" in runs["graph_step_cuda.py"].why_not


def test_a_later_option_and_the_device_replace_the_stages() -> None:
    how = gpu_rehearsal.OnTheCpu(add=("--batch", "1"), drop=("--big",))
    command = how.command(
        "x.py", ["--batch", "8", "64", "--big", "--device", "cuda", "--n", "cuda"]
    )
    assert command[1:] == [
        "benchmarks/x.py", "--batch", "8", "64", "--device", "cpu", "--n", "cuda", "--batch", "1"
    ]  # fmt: skip
    assert how.command("y.py", [])[1:] == ["benchmarks/y.py", "--device", "cpu", "--batch", "1"]


def _fake_run(failing: str):
    """gpu_check._run's stand-in: each command succeeds and writes its report, but the one
    naming ``failing``, which exits 1 saying why."""
    commands: list[list[str]] = []

    def run(command: list[str], seconds: float) -> subprocess.CompletedProcess:
        commands.append(command)
        if any(failing in a for a in command):
            return subprocess.CompletedProcess(command, 1, "", "Traceback ...\nValueError: boom")
        junit = next((a.split("=", 1)[1] for a in command if a.startswith("--junitxml=")), None)
        if junit:
            Path(junit).write_text(
                '<testsuites><testsuite tests="9" failures="0" errors="0" skipped="7"/>'
                "</testsuites>"
            )
        if "--json" in command:
            Path(command[command.index("--json") + 1]).write_text("{}")
        return subprocess.CompletedProcess(command, 0, "", "")

    return run, commands


@pytest.mark.parametrize("failing", ["fp8_step.py", "no such script"])
def test_the_rehearsal_names_a_failing_script_and_fails(
    failing: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run, commands = _fake_run(failing)
    monkeypatch.setattr(gpu_check, "_run", run)
    code = gpu_rehearsal.main([])
    out = capsys.readouterr().out
    summary = out[out.index("== gpu-check's scripts") :]
    assert "not rehearsed (CUDA only" in summary  # graph_step_cuda.py, named
    ran = [next(a for a in c if a.endswith(".py") or a == "pytest") for c in commands]
    assert "benchmarks/kernel_sweep.py" in ran  # its builds
    if failing == "fp8_step.py":
        assert code == 1
        assert "fp8_step.py" in summary and "FAILED: exit status 1: ValueError: boom" in summary
        assert summary.count("FAILED") == 1
    else:
        assert code == 0 and "FAILED" not in summary
        assert summary.count("ran (") == len(
            [r for r in gpu_rehearsal.rehearsals() if r.command is not None or r.tests]
        )


def test_a_cuda_test_that_fails_fails_the_rehearsal(monkeypatch: pytest.MonkeyPatch) -> None:
    def run(command: list[str], seconds: float) -> subprocess.CompletedProcess:
        junit = next(a.split("=", 1)[1] for a in command if a.startswith("--junitxml="))
        Path(junit).write_text('<testsuite tests="9" failures="1" errors="0" skipped="7"/>')
        return subprocess.CompletedProcess(command, 1, "", "")

    monkeypatch.setattr(gpu_check, "_run", run)
    assert gpu_rehearsal.rehearse_tests(10.0) == "1 failed (exit status 1)"
