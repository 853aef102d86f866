"""A build of amp_graph's extensions that was killed midway cannot hang the next one.

cpp_extension's lock file (``lock`` in the build directory) outlives a process killed while it
builds, and every later ``load`` then waits for it forever: the first monitored step of a run
never returned (a CI run spent its 90 minutes there). ``amp_graph.ops.extension_build`` holds
an OS lock instead, which the kernel frees with its holder, and clears a baton found under it.
"""

from __future__ import annotations

import inspect
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from amp_graph.ops import extension_build
from amp_graph.ops.cpu_extension import extension_name, load_cpu_extension
from amp_graph.ops.extension_build import (
    BATON_NAME,
    build_directory,
    exclusive_build,
    load_built,
    torch_waits_on_a_baton,
)


def test_torch_waits_on_a_baton_where_its_cpp_extension_has_one() -> None:
    from torch.utils import file_baton

    uses = "FileBaton" in inspect.getsource(cpp_extension._jit_compile)
    assert torch_waits_on_a_baton() == uses
    assert uses or not hasattr(cpp_extension, "FileBaton")
    assert file_baton.FileBaton  # what 2.13 waits on while its file exists


def test_a_baton_left_by_a_killed_build_is_removed_with_a_warning(
    tmp_path, caplog, monkeypatch
) -> None:
    monkeypatch.setattr(extension_build, "torch_waits_on_a_baton", lambda: True)
    (tmp_path / BATON_NAME).touch()
    with caplog.at_level(logging.WARNING), exclusive_build(tmp_path):
        assert not (tmp_path / BATON_NAME).exists()
    assert "killed before it finished" in caplog.text and str(tmp_path / BATON_NAME) in caplog.text


def test_a_live_build_in_another_process_is_waited_for_and_its_baton_kept(tmp_path, caplog) -> None:
    started, finished = tmp_path / "started", tmp_path / "finished"
    builder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import pathlib, time
                from amp_graph.ops.extension_build import exclusive_build
                directory = pathlib.Path({str(tmp_path)!r})
                with exclusive_build(directory):
                    (directory / {BATON_NAME!r}).touch()  # as cpp_extension does
                    (directory / "started").touch()
                    time.sleep(1.0)
                    (directory / {BATON_NAME!r}).unlink()
                    (directory / "finished").touch()
                """
            ),
        ]
    )
    try:
        while not started.exists():
            assert builder.poll() is None, "the builder exited before it started"
            time.sleep(0.01)
        with caplog.at_level(logging.WARNING), exclusive_build(tmp_path):
            assert finished.exists()  # we got the lock only after the builder was done
        assert "killed" not in caplog.text
    finally:
        builder.wait(timeout=60)
    assert builder.returncode == 0


def test_the_build_directory_is_cpp_extensions_own(tmp_path, monkeypatch) -> None:
    name = extension_name(torch.__version__, torch.backends.cpu.get_cpu_capability())
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    # the private helper that cpp_extension.load itself uses: a cache from before is reused
    assert build_directory(name) == Path(cpp_extension._get_build_directory(name, False))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build_directory(name) == tmp_path / name


def test_the_statistics_kernel_loads_after_a_build_was_killed(tmp_path) -> None:
    """End to end, in a fresh process: the cached build (copied, so nothing recompiles) with
    the baton a killed build leaves. Before the fix this process never returned."""
    assert load_cpu_extension()  # ninja and g++ are in the dev setup (test_monitor.py)
    name = extension_name(torch.__version__, torch.backends.cpu.get_cpu_capability())
    shutil.copytree(build_directory(name), tmp_path / name)
    (tmp_path / name / BATON_NAME).touch()
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            "from amp_graph.ops.cpu_extension import load_cpu_extension, cpu_extension_status\n"
            "assert load_cpu_extension(), cpu_extension_status()",
        ],
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert loaded.returncode == 0, loaded.stderr
    if torch_waits_on_a_baton():  # torch 2.13: the baton would have hung it, and goes
        assert "killed before it finished" in loaded.stderr
        assert not (tmp_path / name / BATON_NAME).exists()
    else:  # torch 2.15 holds an OS lock on that file: left alone, no warning
        assert "killed before it finished" not in loaded.stderr


def test_load_built_builds_in_its_build_directory(tmp_path, monkeypatch) -> None:
    """A two-line extension built through load_built lands where build_directory says."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    source = tmp_path / "tiny.cpp"
    source.write_text("int amp_graph_tiny() { return 1; }\n")
    load_built("amp_graph_test_tiny", sources=[str(source)], is_python_module=False)
    assert (build_directory("amp_graph_test_tiny") / "amp_graph_test_tiny.so").exists()
