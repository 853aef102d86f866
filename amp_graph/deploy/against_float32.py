"""What an exported program costs and how close it stays to float32: file and state sizes
against the float32 export's, casts, the float32 islands, and the output error against the
float32 model on sample inputs. The ``export`` command prints it; the benchmark and the
notebook read it.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.export import ExportedProgram

from amp_graph.accuracy.autopolicy_search import as_call
from amp_graph.accuracy.float32_error import OutputError

from .program import ExportInfo, eval_mode, export_info, sample_errors
from .targets import load, save


def error_against_float32(
    run: Callable[..., Any], model: nn.Module, samples: Sequence[Any]
) -> OutputError:
    """The worst :func:`output_error` of ``run`` against ``model`` in float32 (eval mode,
    no autograd) over ``samples`` (tuples of arguments, dicts of keyword arguments, or
    tensors)."""
    return OutputError.worst(sample_errors(run, model, [as_call(s) for s in samples]))


def state_bytes(program: ExportedProgram) -> int:
    """Bytes of the program's parameters, buffers and constant tensors, each storage once
    (tied weights are two names of one tensor)."""
    tensors = [*program.state_dict.values(), *program.constants.values()]
    storages = {
        (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        for t in tensors
        if isinstance(t, torch.Tensor)
    }
    return sum(nbytes for _, nbytes in storages)


def file_bytes(program: ExportedProgram, format: str) -> int:
    """The size of ``program`` saved in ``format`` (written to a temporary file)."""
    with tempfile.TemporaryDirectory() as folder:
        path = save(program, Path(folder) / "program.pt2", format, check=False)
        return path.stat().st_size


def float32_program(model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any = None):
    """``torch.export`` of the model in float32, eval mode: what the sizes are against."""
    with eval_mode(model), torch.no_grad():
        return torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes)


@dataclass
class DeployReport:
    """One saved program against its float32 export and the float32 model."""

    format: str
    info: ExportInfo
    file_bytes: int
    float32_file_bytes: int
    state_bytes: int
    float32_state_bytes: int
    error: OutputError
    onnx_casts: int | None = None
    onnx_runtime_casts: int | None = None
    onnx_initializers: dict[str, int] = field(default_factory=dict)

    @property
    def size_ratio(self) -> float:
        return self.file_bytes / self.float32_file_bytes

    def lines(self) -> list[str]:
        info = self.info
        out = [
            f"format {self.format}: {self.file_bytes / 1e6:.3f} MB, float32 export "
            f"{self.float32_file_bytes / 1e6:.3f} MB: {self.size_ratio:.3f}x",
            f"state {self.state_bytes / 1e6:.3f} MB, float32 {self.float32_state_bytes / 1e6:.3f}"
            f" MB: {self.state_bytes / self.float32_state_bytes:.3f}x "
            f"({len(info.stored_low)} tensors stored in the low dtype)",
            f"casts in the program: {info.casts}",
        ]
        if self.onnx_casts is not None:
            inits = ", ".join(f"{n} {k}" for k, n in sorted(self.onnx_initializers.items()))
            out.append(f"ONNX: {self.onnx_casts} Cast nodes; initializers: {inits}")
            if self.onnx_runtime_casts and self.onnx_runtime_casts > self.onnx_casts:
                out.append(
                    f"onnxruntime's CPU provider runs {self.onnx_runtime_casts} Casts: it "
                    "computes in float32 the low-precision ops it has no kernel for"
                )
        out.append(f"float32 islands: {len(info.islands)}")
        for island in info.islands:
            where = f" in {island.module_path}" if island.module_path else ""
            out.append(f"  {island.node} ({island.op}{where}): {island.why}")
        demoted = ", ".join(info.demoted) or "none"
        out.append(f"demoted by calibration: {demoted}")
        out.append(
            f"max error against float32: {self.error.max_abs:.3g} absolute, "
            f"{self.error.rel_l2:.3g} relative (L2)"
        )
        return out


def deploy_report(
    model: nn.Module,
    program: ExportedProgram,
    path: str | Path,
    format: str,
    samples: Sequence[Any],
    float32: ExportedProgram,
) -> DeployReport:
    """Measure the program ``save`` wrote to ``path``: its size against ``float32`` saved in
    the same format, and the error of the file, loaded and run, against ``model`` in float32
    on ``samples``."""
    report = DeployReport(
        format,
        export_info(program),
        Path(path).stat().st_size,
        file_bytes(float32, format),
        state_bytes(program),
        state_bytes(float32),
        error_against_float32(load(path, format), model, samples),
    )
    if format == "onnx":
        from .onnx_target import onnx_stats

        stats = onnx_stats(path)
        report.onnx_casts, report.onnx_initializers = stats.casts, stats.initializers
        report.onnx_runtime_casts = stats.runtime_casts
    return report
