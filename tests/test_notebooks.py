"""Every notebook in notebooks/ runs top to bottom, and is committed with its outputs."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the notebooks need the dev extra (nbformat)")
nbclient = pytest.importorskip("nbclient", reason="the notebooks need the dev extra (nbclient)")

jupyter_manager = pytest.importorskip("jupyter_client.manager")

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 300


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory(prefix="nb") as sockets:
        # the kernel on unix sockets: TCP ports picked free can be taken by another process
        # (a gloo rank of the other worker) before the kernel binds them
        manager = jupyter_manager.KernelManager(
            kernel_name="python3",
            transport="ipc",
            ip=f"{sockets}/kernel",
            connection_file=f"{sockets}/kernel.json",
        )
        client = nbclient.NotebookClient(
            notebook,
            km=manager,
            timeout=CELL_TIMEOUT_S,
            resources={"metadata": {"path": str(path.parent)}},
        )
        # raises CellExecutionError, naming the cell, if one fails; what the notebook (or
        # torch under it) writes to its temporary directory goes with the sockets'
        client.execute(env={**os.environ, "TMPDIR": sockets})
    errors = [
        o
        for c in notebook.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.output_type == "error"
    ]
    assert not errors


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_saved_executed(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    code = [c for c in notebook.cells if c.cell_type == "code" and c.source.strip()]
    assert code, f"{path.name} has no code"
    unrun = [i for i, c in enumerate(code) if c.execution_count is None]
    assert not unrun, f"{path.name}: code cells {unrun} were saved without running"
    assert any(c.outputs for c in code), f"{path.name} was saved without outputs"
