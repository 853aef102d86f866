"""The amp-graph CLI: end to end on tests/sample_model.py, and clear errors for bad input."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import types
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from amp_graph.cli import UsageError, main, parse_shape

SAMPLE = str(Path(__file__).with_name("sample_model.py"))
ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "amp_graph", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        check=False,
    )


def test_inspect_end_to_end(tmp_path):
    svg, html = tmp_path / "net.svg", tmp_path / "net.html"
    done = run(
        "inspect",
        f"{SAMPLE}:SmallNet",
        "--input-shape",
        "2,3,16,16",
        "--policy",
        "O1",
        "--svg",
        str(svg),
        "--html",
        str(html),
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.splitlines()[0].split()[:3] == ["node", "op", "module"]
    assert "model_conv_weight_bf16" in out and "casts inserted 6" in out
    assert "aten.conv2d" in out and "aten.softmax.int" in out  # aten-level nodes
    assert "casts fwd" in out and "backward:" in out  # the data-flow summary
    root = ET.fromstring(svg.read_text())
    titles = {
        g.find("{http://www.w3.org/2000/svg}title").text
        for g in root.iter("{http://www.w3.org/2000/svg}g")
        if "cast" in g.get("class", "").split()
    }
    assert titles == {  # the input, conv's and head's weights and biases (the softmax
        # widens the head's output itself: its dtype=)
        "x_bf16",
        "model_conv_weight_bf16",
        "model_conv_bias_bf16",
        "model_head_weight_bf16",
        "model_head_bias_bf16",
    }
    page = html.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and "<table" in page
    assert "What the passes changed" in page
    assert "Traceback" not in done.stderr


def test_explain_end_to_end():
    done = run("explain", f"{SAMPLE}:SmallNet", "--input-shape", "2,3,16,16", "softmax")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("'softmax' (aten.softmax.int) returns fp32.")
    assert "Its rule is deny" in done.stdout
    assert "It widens its input to fp32 itself, by its dtype= argument" in done.stdout


def test_bad_input_in_a_subprocess_gives_one_line_and_status_2():
    done = run("inspect", "missing_model.py:Net", "--input-shape", "2,3")
    assert done.returncode == 2
    assert done.stderr.strip() == "amp-graph inspect: error: no such file: missing_model.py"
    assert done.stdout == ""


@pytest.mark.skipif(
    shutil.which("amp-graph") is None and not (Path(sys.executable).parent / "amp-graph").exists(),
    reason="the amp-graph console script is not installed",
)
def test_console_script():
    script = shutil.which("amp-graph") or str(Path(sys.executable).parent / "amp-graph")
    done = subprocess.run([script, "--help"], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and "inspect" in done.stdout and "explain" in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["inspect", "nope.py:Net", "--input-shape", "2"], "no such file: nope.py"),
        (
            ["inspect", f"{SAMPLE}:SmallNett", "--input-shape", "2"],
            "has no attribute 'SmallNett'. Did you mean 'SmallNet'?",
        ),
        (
            ["inspect", f"{SAMPLE}:SmallNet", "--input-shape", "2,a,16"],
            "bad --input-shape '2,a,16'",
        ),
        (["inspect", f"{SAMPLE}:SmallNet", "--input-shape", "2,0"], "bad --input-shape '2,0'"),
        (
            ["inspect", f"{SAMPLE}:SmallNet", "--input-shape", "2,5,16,16"],
            "SmallNet fails on inputs of shape (2, 5, 16, 16): RuntimeError",
        ),
        (["inspect", f"{SAMPLE}:not_a_model", "--input-shape", "2"], "is not a model"),
        (
            ["inspect", f"{SAMPLE}:NeedsArguments", "--input-shape", "2,4"],
            "cannot build NeedsArguments()",
        ),
        (["inspect", SAMPLE, "--input-shape", "2"], "MODEL is FILE.py:Name"),
        (["inspect", "amp_graph.no_such_module:Net", "--input-shape", "2"], "cannot import"),
        (
            [
                "inspect",
                f"{SAMPLE}:SmallNet",
                "--input-shape",
                "2,3,8,8",
                "--input-shape",
                "2",
                "--input-dtype",
                "long",
                "--input-dtype",
                "long",
                "--input-dtype",
                "long",
            ],
            "2 --input-shape but 3 --input-dtype",
        ),
        (
            ["explain", f"{SAMPLE}:SmallNet", "--input-shape", "2,3,8,8", "sofmax"],
            "no node named 'sofmax' in the compiled graph. Did you mean 'softmax'?",
        ),
        (
            ["explain", f"{SAMPLE}:SmallNet", "--input-shape", "2,3,8,8", "head"],
            "'head' is a module, not a node of the compiled graph; its ops are 'linear'.",
        ),
        (
            ["inspect", f"{SAMPLE}:SmallNet", "--input-shape", "2,3,8,8", "--keep-fp32", "haed"],
            "--keep-fp32: module path override 'haed' matches no module of the model. "
            "Did you mean 'head'?",
        ),
    ],
)
def test_bad_input_names_what_is_wrong(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_a_model_that_cannot_be_captured_fails_with_the_reason(capsys):
    assert main(["inspect", f"{SAMPLE}:Untraceable", "--input-shape", "2,4"]) == 1
    err = capsys.readouterr().err
    assert "CaptureError" in err and "sample_model.py" in err and "if x.sum() > 0" in err
    assert "torch.where" in err  # the data-dependent branch's way out
    assert "Traceback" not in err and "def forward" not in err  # not export's partial graph


def test_debug_shows_the_traceback():
    with pytest.raises(UsageError, match="no such file"):
        main(["inspect", "nope.py:Net", "--input-shape", "2", "--debug"])


def test_argparse_rejects_unknown_policies(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", f"{SAMPLE}:SmallNet", "--input-shape", "2", "--policy", "O5"])
    assert exit_info.value.code == 2 and "invalid choice: 'O5'" in capsys.readouterr().err


def test_factories_integer_inputs_and_keep_fp32(capsys):
    assert (
        main(
            [
                "inspect",
                f"{SAMPLE}:make_tagger",
                "--input-shape",
                "2,7",
                "--input-dtype",
                "long",
                "--summary",
            ]
        )
        == 0
    )
    assert "casts inserted 3" in capsys.readouterr().out
    assert (
        main(
            [
                "explain",
                f"{SAMPLE}:SmallNet",
                "--input-shape",
                "2,3,8,8",
                "--keep-fp32",
                "head",
                "linear",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("'linear' (aten.linear in module 'head') returns fp32.")
    assert "module path override 'head'" in out


def test_several_inputs_and_a_package_module(capsys):
    assert (
        main(
            [
                "inspect",
                "amp_graph.demo.models:GPTWithLoss",
                "--input-shape",
                "2,8",
                "--input-shape",
                "2,8",
                "--input-dtype",
                "long",
                "--depth",
                "1",
                "--summary",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "gpt" in out and "casts fwd" in out


def test_demo_help_and_forwarding(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--help"])
    assert exit_info.value.code == 0 and "amp_graph.demo" in capsys.readouterr().out
    seen = []
    fake = types.ModuleType("amp_graph.demo")
    fake.main = lambda argv=None: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "amp_graph.demo", fake)
    assert main(["demo", "--", "--steps", "3"]) == 0
    assert main(["demo", "--steps", "3", "--batch", "8"]) == 0
    assert seen == [["--steps", "3"], ["--steps", "3", "--batch", "8"]]


def test_parse_shape():
    assert parse_shape("8,3,32,32") == (8, 3, 32, 32)
    assert parse_shape(" 4 ") == (4,)


def test_demo_says_when_low_precision_is_slow_here():
    from amp_graph.demo import low_precision_verdict

    emulated = low_precision_verdict(30.0, torch.bfloat16, [])
    assert "slow here" in emulated and "emulated" in emulated and "'vs autocast'" in emulated
    no_kernel = low_precision_verdict(8.0, torch.bfloat16, ["avx512_bf16"])
    assert "slow here" in no_kernel and "avx512_bf16" in no_kernel and "emulated" not in no_kernel
    fast = low_precision_verdict(0.6, torch.bfloat16, ["amx_bf16"])
    assert "usable here" in fast and "speed comparison" in fast


def test_demo_steps_fit_the_budget_but_never_fewer_than_the_minimum():
    import io
    import itertools

    from amp_graph.demo import timed_steps

    taken = []
    stream = itertools.repeat((torch.zeros(1), torch.zeros(1)))
    slow = timed_steps(
        lambda x, y: (taken.append(1), time.sleep(0.02)), stream, 0.1, 3, 50, io.StringIO()
    )
    assert 3 <= slow <= 8 and slow == len(taken)  # the budget stops it (0.1 s of 0.02 s steps)
    assert timed_steps(lambda x, y: time.sleep(0.05), stream, 0.01, 4, 50, io.StringIO()) == 4
    assert timed_steps(lambda x, y: None, stream, 10.0, 1, 7, io.StringIO()) == 7


def test_quick_demo_runs_end_to_end(capsys):
    from amp_graph.demo import main as demo_main

    assert demo_main(["--steps", "4", "--batch", "16", "--channels", "4"]) == 0
    out = capsys.readouterr().out
    assert "float32 step" in out and "4 steps per run" in out and "amp_graph.Graph O2" in out


def test_a_wrong_shape_in_a_subprocess_is_one_line_without_torchs_log(tmp_path):
    """FakeTensorMode logs a failing meta kernel (here mm's) with its traceback; the
    command's one line says it all."""
    model = tmp_path / "linear_model.py"
    model.write_text(
        "import torch.nn as nn\n"
        "class Small(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(8, 8)\n"
        "    def forward(self, x):\n"
        "        return self.fc(x)\n"
    )
    done = run("inspect", f"{model}:Small", "--input-shape", "2,9", "--summary")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("amp-graph inspect: error: Small fails on inputs of shape")


DRAWING = ["inspect", f"{SAMPLE}:SmallNet", "--input-shape", "2,3,8,8", "--summary"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--collapse", "-1"], "--collapse is a module depth >= 1 (1 folds each top-level"),
        (["--collapse", "0", "--svg", "x.svg"], "--collapse is a module depth >= 1"),
        (["--max-nodes", "0", "--svg", "x.svg"], "--max-nodes is a number of nodes >= 1; got 0"),
        (["--depth", "-2"], "--depth is a module depth >= 1"),
        (["--focus", "head"], "--focus shapes the drawing: give --svg FILE or --html FILE too"),
        (
            ["--focus", "haed", "--svg", "x.svg"],
            "--focus: focus='haed' names no node and no module of this graph. Did you mean 'head'?",
        ),
    ],
)
def test_bad_drawing_options_are_usage_errors_before_any_output(extra, message, capsys, tmp_path):
    extra = [str(tmp_path / a) if a.endswith(".svg") else a for a in extra]
    assert main([*DRAWING, *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not list(tmp_path.iterdir())
    assert message in captured.err and captured.err.count("\n") == 1
