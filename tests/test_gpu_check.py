"""``make gpu-check`` (benchmarks/gpu_check.py) without a GPU: it refuses loudly and leaves
BENCHMARKS.md alone; with its subprocesses faked, it turns their reports into the GPU table."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402


def _fake_run(command: list[str], seconds: float) -> subprocess.CompletedProcess:
    """Stands in for the stages' subprocesses, writing the reports they would write."""
    out = next((a.split("=", 1)[-1] for a in command if a.startswith("--junitxml=")), None)
    if out is not None:
        Path(out).write_text(
            '<testsuites><testsuite tests="48" failures="0" errors="0" skipped="0"/></testsuites>'
        )
    elif "benchmarks/kernel_bench.py" in command:
        rows = [
            {"case": case, "dtype": dtype, "variant": "unscale", "ours_gbps": gbps,
             "copy_gbps": 3200.0, "speedup_vs_torch": x, "ours_ms": 1.0, "torch_ms": x,
             "ours_host_ns_per_tensor": 40.0, "torch_host_ns_per_tensor": 150.0}
            for case, dtype, gbps, x in (
                ("1x1e8", "fp32", 3100.0, 1.1), ("1x1e8", "fp16", 3040.0, 1.3),
                ("1x1e8", "bf16", 3008.0, float("nan")), ("10000x1e3", "fp32", 900.0, 2.5),
                ("10000x1e4", "fp32", 2500.0, 1.6), ("gpt2_mix", "fp32", 3000.0, 1.4),
                ("gpt2_mix", "fp16", 2900.0, 1.5),
            )
        ]  # fmt: skip
        meta = {"peak_gbps": 3350.0, "peak_source": "table entry 'H100'", "extension": "loaded"}
        Path(command[command.index("--json") + 1]).write_text(
            json.dumps({"meta": meta, "rows": rows})
        )
    elif "benchmarks/scaler_share.py" in command:
        share = {"step_ms": 40.0, "ours_ms": 0.2, "torch_ms": 0.25}
        share |= {"ours_share": 0.005, "torch_share": 0.00625}
        Path(command[command.index("--json") + 1]).write_text(json.dumps(share))
    elif "benchmarks/kernel_sweep.py" in command:
        sweep = [
            {"variant": name, "case": "1x1e8", "dtype": "fp32", "gbps": gbps, "copy_gbps": 4000.0}
            for name, gbps in (("base", 3480.0), ("unroll 8", 3900.0), ("tile 512", 3000.0))
        ]
        Path(command[command.index("--json") + 1]).write_text(json.dumps(sweep))
    elif "benchmarks/cuda_graph_bench.py" in command:
        rows = []
        for batch, hand_ms in ((8, 30.0), (64, 200.0)):
            for dtype, captured_ms in (("bfloat16", 0.4), ("float16", 0.42)):
                ms = {"hand": hand_ms, "Graph O1": hand_ms * 1.1}
                ms["Graph O1 cuda_graph"] = hand_ms * (captured_ms if batch == 8 else 0.9)
                row = {"setup": f"GPT (12 layers, dim 768, {batch}x512 tokens)", "dtype": dtype}
                row |= {
                    name: {
                        "ms": v,
                        "vs_hand": v / hand_ms,
                        "peak_step_mb": 1000.0 + 50 * (i == 2),
                        "first_calls_reserved_mb": 1400.0 + 140 * (i == 2),
                    }
                    for i, (name, v) in enumerate(ms.items())
                }
                if batch == 8 and dtype == "bfloat16":
                    states = {"active_allocated": 100.0, "inactive": 950.0}
                    row["Graph O1 cuda_graph"]["pool"] = {"mib_by_state": states}
                    row["Graph O1 cuda_graph set_to_none"] = {
                        "ms": 11.4,
                        "vs_hand": 0.38,
                        "peak_step_mb": 840.0,
                        "first_calls_reserved_mb": 1232.0,
                    }
                    row["set_to_none_vs_in_place"] = 0.95
                    row["torch.compile reduce-overhead"] = {
                        "ms": 15.0,
                        "vs_hand": 0.5,
                        "peak_step_mb": 900.0,
                    }
                    row["captured_vs_compile"] = 0.8
                    row["compiled_captured_vs_compile"] = 0.7
                    row["Graph O1 enable_compile cuda_graph"] = {
                        "ms": 10.5,
                        "vs_hand": 0.35,
                        "peak_step_mb": 1000.0,
                    }
                    for name, x in (
                        ("compile O1 cuda_graph", 0.6),
                        ("compile O1", 1.05),
                        ("amp_graph backend reduce-overhead", 0.55),
                    ):
                        row[name] = {"ms": 30 * x, "vs_hand": x, "peak_step_mb": 900.0}
                rows.append(row)
        Path(command[command.index("--json") + 1]).write_text(json.dumps(rows))
    elif "benchmarks/compile_modes.py" in command:
        rows = {
            "autocast eager": (1.0, False, 0.5),
            "torch.compile + autocast": (0.6, False, 40.0),
            "compile eager": (1.03, False, 1.0),
            "compile default": (0.62, True, 30.0),
            "Graph": (1.04, True, 1.2),
            "Graph enable_compile": (0.61, False, 35.0),
        }
        report = {
            "results": [
                {
                    "model": "gpt",
                    "rows": {
                        name: {"vs_autocast_eager": r, "default": d, "first_call_s": s}
                        for name, (r, d, s) in rows.items()
                    },
                }
            ]
        }
        Path(command[command.index("--json") + 1]).write_text(json.dumps(report))
    elif "benchmarks/fp8_cost_model.py" in command:
        rows = [
            {"shape": [16384, 4096, 4096], "predicted": 0.7, "measured": 0.75, "right": True},
            {"shape": [4096, 768, 768], "predicted": 1.2, "measured": 1.1, "right": True},
        ]
        report = {"model": "cuda:0: figures", "rows": rows}
        Path(command[command.index("--json") + 1]).write_text(json.dumps(report))
    elif "benchmarks/mfu.py" in command:
        rows = [
            {"batch": batch, "variant": "Graph O1 compile cuda_graph", "ms": ms,
             "tflops": tflops, "mfu_spec": tflops / 989.4, "mfu_matmul": tflops / 780.0,
             "step_tflop": tflops * ms / 1e3}
            for batch, ms, tflops in ((16, 60.0, 300.0), (32, 100.0, 400.0))
        ]  # fmt: skip
        report = {"peak_tflops": {"spec": 989.4, "matmul": 780.0}, "rows": rows}
        report["at_target"] = rows[1]
        Path(command[command.index("--json") + 1]).write_text(json.dumps(report))
    elif "benchmarks/fp8_step.py" in command:
        steps = {
            "bf16 torch.compile": {"ms": 130.0, "tflops": 600.0, "speedup_vs_bf16": 1.0},
            "fp8 amp_graph tensorwise": {"ms": 100.0, "tflops": 780.0, "speedup_vs_bf16": 1.3},
            "fp8 torchao tensorwise": {"error": "RuntimeError: torchao is not installed here"},
        }
        loss = {"steps": 200, "final": {"bf16": 2.1, "fp8 amp_graph tensorwise": 2.105},
                "allowed": 0.01, "within": {"fp8 amp_graph tensorwise": True}}  # fmt: skip
        report = {"steps": steps, "loss": loss}
        Path(command[command.index("--json") + 1]).write_text(json.dumps(report))
    elif "benchmarks/eager_step.py" in command:
        names = [f"O1, {setting}" for setting in ("auto", "every cast", "none")]
        report = {
            "cost": {"min_copy_bytes": 45 * 2**20},
            "steps": [
                {
                    "ratios": dict(zip(names, (1.04, 1.2, 1.05), strict=True)),
                    "decided": dict.fromkeys(names, "0 recomputed (0.00 MiB), 73 kept"),
                }
            ],
        }
        Path(command[command.index("--json") + 1]).write_text(json.dumps(report))
    else:
        step = {"syncs_per_step": 0, "bit_equal": True, "eager_ms": 2.0, "captured_ms": 0.5}
        Path(command[command.index("--json") + 1]).write_text(json.dumps(step | {"speedup": 4.0}))
    return subprocess.CompletedProcess(command, 0, "", "")


def test_figures_land_in_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    md = tmp_path / "BENCHMARKS.md"
    md.write_text((ROOT / "BENCHMARKS.md").read_text())
    monkeypatch.setattr(gpu_check, "preflight", lambda: [])
    monkeypatch.setattr(gpu_check, "_run", _fake_run)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    results = tmp_path / "results" / "gpu-check.json"
    assert gpu_check.main(["--benchmarks-md", str(md), "--results-json", str(results)]) == 0
    text = md.read_text()
    assert "on NVIDIA H100 80GB HBM3" in text
    assert "| 48 passed, 0 failed, 0 skipped |" in text
    assert "| 3100 GB/s, 93% of 3350 GB/s; 0.97x copy_ (3200 GB/s) |" in text
    assert "| 3040 GB/s; 0.95x copy_ (3200 GB/s) |" in text
    assert "| 2.50x (1.000 ms vs 2.500 ms) |" in text
    assert "| 1.50x (1.000 ms vs 1.500 ms) |" in text  # gpt2_mix fp16
    assert "| 40 ns vs 150 ns |" in text
    assert "| amp_graph 0.200 ms (0.50%), torch's op 0.250 ms (0.62%) of a 40.00 ms step |" in text
    assert "| 0.87x / 0.97x (unroll 8) |" in text
    assert "| host syncs per Graph step (fp16 O1, fused AdamW) | 0 | 0 |" in text
    assert "bit-equal to uncaptured | yes | yes |" in text
    assert "| copies below 45.0 MiB kept; auto: 0 recomputed (0.00 MiB), 73 kept; " in text
    assert "73 kept; 1.040 / 1.200 / 1.050 |" in text
    assert "| 0.400x (12.00 ms vs 30.00 ms); 0.420x (12.60 ms vs 30.00 ms) |" in text
    assert "| <= 0.90x | 0.800x (15.00 ms) |" in text
    assert "| <= 0.90x | 0.700x; 0.350x (10.50 ms) |" in text
    assert "| <= 0.95x | 0.900x (180.00 ms vs 200.00 ms); 0.900x" in text
    assert (
        "| <= 1.10x | 1.05x (1050 / 1000 MB; pool 100 MB live, 950 MB free); the first five "
        "calls (warm-ups and the capture) reserve 1.10x (1540 / 1400 MB) |"
    ) in text
    assert (
        "| < 1.00x | 0.950x (11.40 / 12.00 ms); 0.80x (840 / 1050 MB); 0.80x (1232 / 1540 MB) |"
        in text
    )
    assert "| - | 0.600x; 1.050x; 0.550x |" in text
    assert (
        "| gpt: eager 1.030, default* 0.620; torch.compile 0.600; Graph* 1.040; "
        "Graph enable_compile 0.610; first call 30 s |"
    ) in text
    assert "| cuda:0: figures; 16384x4096x4096 0.70/0.75; 4096x768x768 1.20/1.10; 2 of 2 " in text
    assert "| >= 40% | 32x1024: 40.4% of 989, 51.3% of the measured matmul's 780 TFLOP/s " in text
    assert (
        "(400 TFLOP/s, 100.0 ms, 40.00 TFLOP a step); batches measured 16 30.3%, 32 40.4% |" in text
    )
    assert (
        "| ours 1.30x bf16 (100.0 ms vs 130.0 ms, 780 vs 600 TFLOP/s); torchao not measured "
        in text
    )
    assert "| after 200 steps: bf16 2.1000 (noise 0.0100); amp_graph tensorwise 2.1050 |" in text
    assert gpu_check.NOT_MEASURED not in text
    # Every figure, machine-readable, with where it was measured.
    record = json.loads(results.read_text())
    assert record["device"] == "NVIDIA H100 80GB HBM3" and record["torch"] == torch.__version__
    assert len(record["commit"]) == 40 and isinstance(record["uncommitted"], list)
    assert set(record["figures"]) == {key for key, _, _ in gpu_check.FIGURES}
    assert None not in record["figures"].values()
    assert len(record["kernel_bench"]["rows"]) == 7 and record["graph_step"]["bit_equal"]
    assert set(record["stage_seconds"]) == {stage.__name__ for stage, _ in gpu_check.STAGES}
    # Only the section changed.
    before, after = (ROOT / "BENCHMARKS.md").read_text(), text
    head = before.split(gpu_check.BEGIN)[0]
    tail = before.split(gpu_check.END)[1]
    assert after.startswith(head) and after.endswith(tail)


def test_a_failing_stage_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_run(command: list[str], seconds: float) -> subprocess.CompletedProcess:
        if "benchmarks/graph_step_cuda.py" in command:
            return subprocess.CompletedProcess(command, 1, "", "boom")
        return _fake_run(command, seconds)

    md = tmp_path / "BENCHMARKS.md"
    md.write_text((ROOT / "BENCHMARKS.md").read_text())
    monkeypatch.setattr(gpu_check, "preflight", lambda: [])
    monkeypatch.setattr(gpu_check, "_run", failing_run)
    monkeypatch.setattr(gpu_check, "RESULTS_JSON", tmp_path / "gpu-check.json")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "GPU")
    assert gpu_check.main(["--benchmarks-md", str(md)]) == 1
    assert "run_graph_step: graph_step_cuda.py failed (exit 1)" in md.read_text()


def test_each_figure_belongs_to_one_stage() -> None:
    """What a stage the budget never reaches falls back to (the earlier run's figures) covers
    every figure of the table, each under one stage."""
    owned = [key for keys in gpu_check.STAGE_FIGURES.values() for key in keys]
    assert sorted(owned) == sorted(key for key, _, _ in gpu_check.FIGURES)
    assert list(gpu_check.STAGE_FIGURES) == [stage for stage, _ in gpu_check.STAGES]


def test_benchmarks_md_has_the_gpu_table() -> None:
    text = (ROOT / "BENCHMARKS.md").read_text()
    section = text.split(gpu_check.BEGIN)[1].split(gpu_check.END)[0]
    for _, what, target in gpu_check.FIGURES:
        assert f"| {what} | {target} |" in section
    with pytest.raises(gpu_check.GpuCheckError, match="exactly one"):
        gpu_check.replace_section("no markers here", "table")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_a_gpu_it_fails_loudly_and_writes_nothing(tmp_path: Path) -> None:
    md = tmp_path / "BENCHMARKS.md"
    md.write_text((ROOT / "BENCHMARKS.md").read_text())
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/gpu_check.py"), "--benchmarks-md", str(md)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    assert "GPU CHECK NOT RUN" in run.stderr and "no CUDA GPU" in run.stderr
    assert md.read_text() == (ROOT / "BENCHMARKS.md").read_text()


def test_only_a_cuda_test_skipped_on_the_gpu_fails_the_check() -> None:
    """Under ``-m cuda`` a module that skips as a whole (an optional extra missing) still
    reports a skip; that is not a CUDA test skipping on the GPU, which fails the check."""
    from xml.etree import ElementTree

    suite = ElementTree.fromstring(
        '<testsuite tests="4" skipped="3">'
        '<testcase name="a"><skipped message="needs a CUDA device"/></testcase>'
        '<testcase name="b"><skipped message="the notebooks need the dev extra"/></testcase>'
        '<testcase name="c"><skipped message="Skipped: needs a GPU with float8"/></testcase>'
        '<testcase name="d"/></testsuite>'
    )
    assert gpu_check.gpu_skipped(suite) == 2


def test_a_stage_cut_short_keeps_what_it_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A benchmark killed at its limit gives the rows it wrote so far (and the timeout is a
    failure); a variant that failed is named; a stage the budget never reached shows the
    earlier run's figures, saying so; --log-dir keeps each command's whole output."""

    def cut_run(command: list[str], seconds: float) -> subprocess.CompletedProcess:
        done = _fake_run(command, seconds)
        if "benchmarks/cuda_graph_bench.py" not in command:
            return done
        report = Path(command[command.index("--json") + 1])
        rows = json.loads(report.read_text())[:2]  # 8x512 only: killed during 64x512
        rows[1]["Graph O1 cuda_graph"] = {"error": "CudaGraphError: a host sync in capture"}
        report.write_text(json.dumps(rows))
        return subprocess.CompletedProcess(command, gpu_check.TIMED_OUT, "rows", "killed")

    md = tmp_path / "BENCHMARKS.md"
    md.write_text((ROOT / "BENCHMARKS.md").read_text())
    earlier = tmp_path / "gpu-check.json"
    earlier.write_text(
        json.dumps({"date": "2026-01-01", "device": "GPU-A", "figures": {"sweep": "0.9x"}})
    )
    monkeypatch.setattr(gpu_check, "preflight", lambda: [])
    monkeypatch.setattr(gpu_check, "_run", cut_run)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "GPU-B")
    clock = iter(range(0, 10_000, 100))  # each look at the clock: 100 s later
    monkeypatch.setattr(gpu_check.time, "monotonic", lambda: next(clock))
    argv = ["--benchmarks-md", str(md), "--results-json", str(earlier), "--budget", "1850"]
    assert gpu_check.main(argv) == 1
    text = md.read_text()
    assert "| <= 0.45x | 0.400x (12.00 ms vs 30.00 ms); float16: failed |" in text
    assert "| <= 0.95x | not yet measured" in text  # 64x512 never ran
    assert "cuda_graph_bench.py ran past its" in text and "a host sync in capture" in text
    assert "| 0.9x (earlier run: 2026-01-01, GPU-A) |" in text
    assert "run_kernel_sweep: out of time before this stage" in text
    record = json.loads(earlier.read_text())
    assert record["device"] == "GPU-B" and record["figures"]["sweep"].startswith("0.9x (earlier")


def test_run_keeps_whole_logs_and_a_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu_check, "LOG_DIR", [tmp_path / "logs"])
    code = "import time; print('started', flush=True); time.sleep(30)"
    done = gpu_check._run([sys.executable, "-c", code, "slow.py"], 3)
    assert done.returncode == gpu_check.TIMED_OUT and "started" in done.stdout
    log = (tmp_path / "logs" / "slow.log").read_text()
    assert "started" in log and "killed at its 3 s limit" in log


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie no init has reaped yet counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


# a command that starts a child of its own (as pytest-xdist and inductor's compile pool do),
# prints the child's pid and then sleeps (or exits at once, leaving the child running)
_SPAWNS = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen(['sleep', '60'])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(float(sys.argv[1]))\n"
)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to see the child")
@pytest.mark.parametrize("sleeps", [30, 0], ids=["killed at its limit", "exits, child left"])
def test_a_stage_leaves_no_process_behind(
    sleeps: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu_check, "LOG_DIR", [])
    done = gpu_check._run([sys.executable, "-c", _SPAWNS, str(sleeps)], 3)
    assert done.returncode == (gpu_check.TIMED_OUT if sleeps else 0)
    child = int(done.stdout.split()[0])
    for _ in range(50):  # SIGKILL is delivered at once; its reaping may take a moment
        if not _alive(child):
            break
        time.sleep(0.1)
    assert not _alive(child), "the stage's child outlived it"


def test_the_cuda_tests_share_the_gpu_in_several_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    report = tmp_path / "junit.xml"
    command = gpu_check.cuda_tests_command(report, 4)
    assert command[command.index("-m", 3) + 1] == "cuda" and f"--junitxml={report}" in command
    assert command[command.index("-n") + 1] == "4"
    assert command[command.index("--dist") + 1] == "loadfile"
    assert "-n" not in gpu_check.cuda_tests_command(report, 1)
    real_find_spec = gpu_check.importlib.util.find_spec
    monkeypatch.setattr(
        gpu_check.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "xdist" else real_find_spec(name, *a),
    )
    assert "-n" not in gpu_check.cuda_tests_command(report, 4), "xdist missing: one process"


def test_a_failing_variant_leaves_the_others_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    import cuda_graph_bench

    setup = cuda_graph_bench.gpt_setup(2, "cpu", tiny=True)
    built = cuda_graph_bench.variants(setup, torch.bfloat16, compiled=False, capture=False)

    def broken() -> tuple:
        raise RuntimeError("capture failed")

    built["broken"] = broken
    monkeypatch.setattr(cuda_graph_bench, "variants", lambda *a, **k: built)
    row = cuda_graph_bench.measure(setup, torch.bfloat16, compiled=False, repeats=2)
    assert row["broken"] == {"error": "RuntimeError: capture failed"}
    assert row["hand"]["vs_hand"] == 1.0 and row["Graph O1"]["ms"] > 0


def test_stages_run_oldest_figures_first(tmp_path: Path) -> None:
    """After the tests, the stages whose figures an earlier run never measured, then the oldest:
    what a budget cut short left out runs first next time."""
    record = tmp_path / "gpu-check.json"
    every = {key: "1.0x" for key, _, _ in gpu_check.FIGURES}
    every["mfu"] = gpu_check.NOT_MEASURED
    every["sweep"] = "0.9x (earlier run: 2026-01-01, GPU-A)"
    record.write_text(json.dumps({"date": "2026-02-01", "figures": every}))
    order = [stage for stage, _ in gpu_check.stage_order(record)]
    assert order[:3] == [gpu_check.run_tests, gpu_check.run_mfu, gpu_check.run_kernel_sweep]
    rest = [stage for stage, _ in gpu_check.STAGES if stage not in order[:3]]
    assert order[3:] == rest  # equally old: the listed order
    assert gpu_check.measured_on(record, ("sweep", "tests")) == "2026-01-01"
    assert gpu_check.measured_on(tmp_path / "none.json", ("tests",)) == ""
    assert [stage for stage, _ in gpu_check.stage_order(tmp_path / "none.json")] == [
        stage for stage, _ in gpu_check.STAGES
    ]


def test_a_stand_in_names_the_run_that_measured_it(tmp_path: Path) -> None:
    record = tmp_path / "gpu-check.json"
    figures = {"sweep": "0.9x (earlier run: 2026-01-01, GPU-A)", "mfu": gpu_check.NOT_MEASURED}
    record.write_text(json.dumps({"date": "2026-02-01", "device": "GPU-B", "figures": figures}))
    assert gpu_check.earlier_figures(record, ("sweep", "mfu")) == {"sweep": figures["sweep"]}


def _earlier_record(path: Path, figures: dict[str, str]) -> None:
    path.write_text(json.dumps({"date": "2026-01-01", "device": "GPU-A", "figures": figures}))


def _fake_run_editing(script: str, edit: Callable[[dict], None]) -> Callable:
    """``_fake_run``, with the report of ``script`` changed by ``edit`` before the check reads
    it."""

    def run(command: list[str], seconds: float) -> subprocess.CompletedProcess:
        done = _fake_run(command, seconds)
        if f"benchmarks/{script}" in command:
            out = Path(command[command.index("--json") + 1])
            report = json.loads(out.read_text())
            edit(report)
            out.write_text(json.dumps(report))
        return done

    return run


def _run_main(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *extra: str) -> tuple[int, str]:
    md = tmp_path / "BENCHMARKS.md"
    md.write_text((ROOT / "BENCHMARKS.md").read_text())
    monkeypatch.setattr(gpu_check, "preflight", lambda: [])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "GPU-B")
    record = tmp_path / "gpu-check.json"
    code = gpu_check.main(["--benchmarks-md", str(md), "--results-json", str(record), *extra])
    return code, md.read_text()


def test_a_stage_that_breaks_costs_neither_the_run_nor_its_earlier_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any exception in a stage (here a report without the key its reader wants) is that
    stage's failure: the other stages are measured, both files are written, and the broken
    stage's cells keep the earlier run's figures, saying so."""
    _earlier_record(tmp_path / "gpu-check.json", {"fp8_cost": "all right", "mfu": "41%"})

    def broken(seconds: float, results: gpu_check.Results) -> None:
        raise KeyError("rows")

    monkeypatch.setattr(gpu_check, "_run", _fake_run)
    stages = [(broken if s is gpu_check.run_fp8_cost else s, t) for s, t in gpu_check.STAGES]
    monkeypatch.setattr(gpu_check, "STAGES", stages)
    monkeypatch.setitem(gpu_check.STAGE_FIGURES, broken, ("fp8_cost",))
    code, text = _run_main(tmp_path, monkeypatch)
    assert code == 1
    assert "broken: KeyError: 'rows'" in text
    assert "| all right (earlier run: 2026-01-01, GPU-A) |" in text
    assert "| >= 40% | 32x1024: 40.4% of 989" in text  # the stage after it was measured
    record = json.loads((tmp_path / "gpu-check.json").read_text())
    assert record["device"] == "GPU-B" and record["figures"]["fp8_cost"].startswith("all right")


def test_only_runs_the_stages_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--only mfu``: that stage alone runs (the tests too are left out); every other cell
    shows the earlier run's figure, saying so."""
    _earlier_record(tmp_path / "gpu-check.json", {"tests": "48 passed", "mfu": "30%"})
    commands: list[list[str]] = []

    def run(command: list[str], seconds: float) -> subprocess.CompletedProcess:
        commands.append(command)
        return _fake_run(command, seconds)

    monkeypatch.setattr(gpu_check, "_run", run)
    code, text = _run_main(tmp_path, monkeypatch, "--only", "mfu")
    assert code == 0
    assert len(commands) == 1 and "benchmarks/mfu.py" in commands[0]
    assert "| 48 passed (earlier run: 2026-01-01, GPU-A) |" in text
    assert "| >= 40% | 32x1024: 40.4% of 989" in text
    with pytest.raises(SystemExit):
        gpu_check.main(["--only", "mfuu"])  # argparse names the stages


def test_a_cell_that_says_not_measured_is_no_figure(tmp_path: Path) -> None:
    """fp8_step's "not measured (cut short)" loss cell: its stage ranks as never measured,
    and the cell is not carried into the next run as an earlier figure."""
    record = tmp_path / "gpu-check.json"
    figures = {"fp8_step": "1.3x", "fp8_loss": "not measured (cut short)"}
    _earlier_record(record, figures)
    assert gpu_check.measured_on(record, ("fp8_step", "fp8_loss")) == ""
    assert gpu_check.earlier_figures(record, ("fp8_step", "fp8_loss")) == {
        "fp8_step": "1.3x (earlier run: 2026-01-01, GPU-A)"
    }


def test_an_fp8_step_cut_short_shows_each_variant_timed_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def cut_run(command: list[str], seconds: float) -> subprocess.CompletedProcess:
        if "benchmarks/fp8_step.py" not in command:
            return _fake_run(command, seconds)
        steps = {
            "bf16 torch.compile": {"solo_ms": 130.0},
            "fp8 amp_graph tensorwise": {"solo_ms": 100.0},
        }  # killed while torchao's variant compiled
        Path(command[command.index("--json") + 1]).write_text(json.dumps({"steps": steps}))
        return subprocess.CompletedProcess(command, gpu_check.TIMED_OUT, "", "killed")

    monkeypatch.setattr(gpu_check, "_run", cut_run)
    code, text = _run_main(tmp_path, monkeypatch, "--only", "fp8_step")
    assert code == 1  # the timeout is a failure
    assert "ours 1.30x bf16 (100.0 ms vs 130.0 ms); torchao not measured (not run) (each " in text
    assert "timed alone after its compile: the interleaved rounds did not run)" in text


def test_a_compile_mode_that_fails_is_named_and_the_others_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """compile_modes.py reports a variant that failed in its row; the check names it among
    the failures and in the cell, and shows the rest."""

    def fail_default(report: dict) -> None:
        report["results"][0]["rows"]["compile default"] = {"error": "BackendCompilerFailed"}

    monkeypatch.setattr(gpu_check, "_run", _fake_run_editing("compile_modes.py", fail_default))
    code, text = _run_main(tmp_path, monkeypatch, "--only", "compile_modes")
    assert code == 1
    assert "compile_modes.py, gpt, compile default: BackendCompilerFailed" in text
    assert "| gpt: eager 1.030; torch.compile 0.600; Graph* 1.040; " in text
    assert "first call failed; failed: compile default |" in text


def test_compile_modes_reports_a_variant_that_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    import compile_modes

    model, inputs, _ = compile_modes.setups("cpu", tiny=True, layers=1)["gpt"]
    real = compile_modes.variants

    def with_a_broken_one(*args: object) -> dict:
        built = {k: v for k, v in real(*args).items() if "compile" not in k}  # no inductor
        built["compile default"] = lambda: (_ for _ in ()).throw(RuntimeError("no compiler"))
        return built

    monkeypatch.setattr(compile_modes, "variants", with_a_broken_one)
    result = compile_modes.measure("gpt", model, inputs, torch.bfloat16, "cpu", repeats=2)
    assert result["rows"]["compile default"] == {"error": "RuntimeError: no compiler"}
    assert result["rows"]["Graph"]["default"] and result["rows"]["Graph"]["median_ms"] > 0
    assert "compile default" in compile_modes.render(result, "tiny")


def test_compile_modes_compiles_each_variant_cold_and_reports_a_failing_replay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each variant's first call runs in an inductor cache of its own (its compile is cold,
    whatever compiled before it), and a variant that fails after its first call (where
    reduce-overhead records and replays its CUDA graphs) is reported in its row while the
    others are measured."""
    import os

    import compile_modes

    model, inputs, _ = compile_modes.setups("cpu", tiny=True, layers=1)["gpt"]
    real = compile_modes.variants
    cache_dirs: dict[str, str] = {}

    def seeing_its_cache(name: str, build: Callable) -> Callable:
        def built() -> Callable:
            cache_dirs[name] = os.environ["TORCHINDUCTOR_CACHE_DIR"]
            return build()

        return built

    def replay_fails() -> Callable:
        calls = []

        def step() -> None:
            calls.append(1)
            if len(calls) > 1:
                raise RuntimeError("replay failed")

        return step

    def variants(*args: object) -> dict:
        built = {k: v for k, v in real(*args).items() if "compile" not in k}  # no inductor
        built = {name: seeing_its_cache(name, build) for name, build in built.items()}
        built["compile reduce-overhead"] = replay_fails
        return built

    monkeypatch.setattr(compile_modes, "variants", variants)
    result = compile_modes.measure("gpt", model, inputs, torch.bfloat16, "cpu", repeats=2)
    rows = result["rows"]
    assert rows["compile reduce-overhead"] == {"error": "RuntimeError: replay failed"}
    assert rows["autocast eager"]["median_ms"] > 0 and rows["Graph"]["median_ms"] > 0
    assert len(set(cache_dirs.values())) == len(cache_dirs) >= 3, cache_dirs
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] not in cache_dirs.values()


def test_a_stage_starts_only_with_the_time_it_took_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage is started only if the time it took when it last completed is left: one that
    would not finish is skipped, and its time goes to a quick one after it. A stage never
    completed (or whose last run failed) is started with half its limit left."""
    now, ran = [0.0], []
    monkeypatch.setattr(gpu_check, "time", type("Clock", (), {"monotonic": lambda: now[0]}))

    def stage(name: str, takes: float) -> gpu_check.Stage:
        def run(seconds: float, results: gpu_check.Results) -> None:
            now[0] += min(takes, seconds)
            ran.append(name)

        run.__name__ = f"run_{name}"
        return run

    tests, slow, quick, broke, new = (
        stage(name, takes)
        for name, takes in (("tests", 0), ("slow", 90), ("quick", 10), ("broke", 5), ("new", 20))
    )
    monkeypatch.setattr(
        gpu_check,
        "STAGES",
        [(tests, 10.0), (slow, 100.0), (quick, 100.0), (broke, 100.0), (new, 60.0)],
    )
    for name, run in (
        ("tests", tests),
        ("slow", slow),
        ("quick", quick),
        ("broke", broke),
        ("new", new),
    ):
        monkeypatch.setitem(gpu_check.STAGE_FIGURES, run, (name,))
    record = tmp_path / "gpu-check.json"
    record.write_text(
        json.dumps(
            {
                "date": "2026-01-01",
                "figures": {},
                "stage_seconds": {"run_slow": 90, "run_quick": 10, "run_broke": 5},
                "failures": ["run_broke: it broke", "run_slow: out of time before this stage"],
            }
        )
    )
    # a failure forgets the seconds; a stage not started for want of time keeps them
    assert gpu_check.completed_seconds(record) == {"run_slow": 90.0, "run_quick": 10.0}
    assert gpu_check.seconds_needed(100.0, None) == 50.0
    assert gpu_check.seconds_needed(100.0, 90.0) == 100.0  # a limit it met: at most the limit
    assert gpu_check.seconds_needed(100.0, 10.0) == 17.0

    code, _ = _run_main(tmp_path, monkeypatch, "--budget", "60")
    assert code == 1
    written = json.loads(record.read_text())
    # slow needs 100 of 60 left: skipped; quick (17 needed) runs; broke (last run failed: 50
    # needed, 50 left) runs and takes 5; new (30 needed, 45 left) runs
    assert ran == ["tests", "quick", "broke", "new"]
    assert written["failures"] == ["run_slow: out of time before this stage (60 s left)"]
    assert gpu_check.completed_seconds(record)["run_slow"] == 90.0  # for the next call
    assert written["stage_seconds"] == {
        "run_slow": 90.0,  # carried from the run that completed it
        "run_tests": 0.0,
        "run_quick": 10.0,
        "run_broke": 5.0,
        "run_new": 20.0,
    }


@pytest.mark.parametrize("installed", [False, True])
def test_make_gpu_check_installs_the_checkout_into_a_fresh_python_first(
    tmp_path: Path, installed: bool
) -> None:
    """A GPU machine is bare: its Python has torch but not amp_graph, and gpu_check.py refuses
    to run without it. ``make gpu-check`` installs this checkout there (offline, editable, no
    dependencies) when its ``amp_graph.passes`` does not import, and only then. The stand-in
    Python runs the Makefile's import check for real (with ``-S``: no site packages, so no
    installed amp_graph, for the fresh machine) and logs every other command."""
    log = tmp_path / "log"
    stub = tmp_path / "python"
    stub.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = "-c" ]; then exec {sys.executable} {"" if installed else "-S"} "$@"; fi\n'
        f'echo "$*" >> {log}\n'
    )
    stub.chmod(0o755)
    done = subprocess.run(
        ["make", "-s", "--no-print-directory", "gpu-check", f"GPU_PYTHON={stub}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    commands = log.read_text().splitlines()
    install = "-m pip install -q --no-deps --no-build-isolation --no-index -e ."
    expected = ([] if installed else [install]) + ["benchmarks/gpu_check.py"]
    # the wheels' install into .whl/site, if this checkout has wheels, comes between
    assert [c for c in commands if "--target .whl/site" not in c] == expected


def test_compile_modes_cold_default_compiles_the_default_first_in_the_runs_own_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--cold default`` (gpu-check's): the default variant is built and called first, every
    variant in the run's own cache (so that those after the default reuse its kernels), only
    the default's first call counts as cold, and the report is handed over after each
    variant's first calls, in the listed order."""
    import os

    import compile_modes

    model, inputs, _ = compile_modes.setups("cpu", tiny=True, layers=1)["gpt"]
    real = compile_modes.variants
    built_in: list[tuple[str, str]] = []
    inductor = ("torch.compile", "default", "enable_compile", "reduce-overhead", "cudagraphs")

    def variants(*args: object) -> dict:
        def seen(name: str, build: Callable) -> Callable:
            return lambda: (
                built_in.append((name, os.environ["TORCHINDUCTOR_CACHE_DIR"])),
                build(),
            )[1]

        kept = {k: v for k, v in real(*args).items() if not any(w in k for w in inductor)}
        return {name: seen(name, build) for name, build in kept.items()}

    monkeypatch.setattr(compile_modes, "variants", variants)
    partials: list[dict] = []
    result = compile_modes.measure(
        "gpt", model, inputs, torch.bfloat16, "cpu", 2, "default", progress=partials.append
    )
    chosen = "compile eager"  # the CPU's default
    assert built_in[0][0] == chosen
    assert {cache for _, cache in built_in} == {os.environ["TORCHINDUCTOR_CACHE_DIR"]}
    rows = result["rows"]
    assert list(rows) == ["autocast eager", "autocast eager [again]", "compile eager", "Graph"]
    assert {name: row["first_call_warm"] for name, row in rows.items()} == {
        name: name != chosen for name in rows
    }
    assert [list(p["rows"]) for p in partials] == [
        ["compile eager"],
        ["autocast eager", "compile eager"],
        ["autocast eager", "autocast eager [again]", "compile eager"],
        ["autocast eager", "autocast eager [again]", "compile eager", "Graph"],
    ]
    assert all("median_ms" not in row for p in partials for row in p["rows"].values())
    assert "(w: a first call that may reuse the default's kernels" in compile_modes.render(
        result, "tiny"
    )


def test_compile_modes_cut_short_gives_its_first_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compile_modes.py killed at its limit before the timed rounds (its report then holds
    first calls only) gives those first calls in its cell, and the timeout is a failure."""

    def run(command: list[str], seconds: float) -> subprocess.CompletedProcess:
        if "benchmarks/compile_modes.py" not in command:
            return _fake_run(command, seconds)
        assert command[command.index("--cold") + 1] == "default"
        rows = {
            "torch.compile + autocast": {"first_call_s": 20.0, "first_call_warm": True},
            "compile default": {"first_call_s": 41.0, "first_call_warm": False},
        }
        report = {"results": [{"model": "gpt", "rows": rows}]}
        Path(command[command.index("--json") + 1]).write_text(json.dumps(report))
        return subprocess.CompletedProcess(command, gpu_check.TIMED_OUT, "", "killed")

    monkeypatch.setattr(gpu_check, "_run", run)
    code, text = _run_main(tmp_path, monkeypatch, "--only", "compile_modes")
    assert code == 1
    assert (
        "| gpt: cut short before the timed rounds; first calls torch.compile + autocast 20 s, "
        "compile default 41 s cold |" in text
    )
    assert "compile_modes.py ran past its" in text


def test_the_kernels_bandwidth_is_also_shown_against_an_in_place_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kernel_bench.py's reports since 2026-12-06 time torch's in-place mul_ of the same bytes
    beside the copy: the ceiling of a kernel that reads and writes the same addresses. The
    check shows ours against it, and it against the copy."""

    def with_in_place(report: dict) -> None:
        for row in report["rows"]:
            row["inplace_gbps"] = 3000.0

    monkeypatch.setattr(gpu_check, "_run", _fake_run_editing("kernel_bench.py", with_in_place))
    code, text = _run_main(tmp_path, monkeypatch, "--only", "kernel_bench")
    assert code == 0
    assert "| 3100 GB/s, 93% of 3350 GB/s; 0.97x copy_ (3200 GB/s); 1.03x an in-place " in text
    assert "| 3200 GB/s, 96% of 3350 GB/s; an in-place mul_ 3000 GB/s, 0.94x copy_ |" in text
