"""The three targets of an exported program: a ``.pt2`` file (``torch.export.save``), an
AOTInductor package, and ONNX run by onnxruntime; each written by :func:`save` and run by
:func:`load`, which takes the model's own arguments.

ONNX needs the ``onnx`` extra (``pip install amp_graph[onnx]``: onnx, onnxscript,
onnxruntime), in :mod:`amp_graph.deploy.onnx_target`, imported only when asked for. A
runtime that lacks a kernel for a low-precision op (onnxruntime's CPU provider has no
bfloat16 ``MatMul``) is a :class:`TargetError` naming the op, the dtype and the target,
raised when the file is written (``check=True``) or loaded: never a silent change of dtype.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

from amp_graph.passes.meta import short
from amp_graph.policy import Policy
from amp_graph.policy.policy_data import PolicyNotData, policy_as_data

from .program import INFO, ExportInfo

FORMATS = ("pt2", "aoti", "onnx")
INFO_FILE = "amp_graph.json"  # the ExportInfo, in a .pt2's extra files and ONNX metadata


def check_format(format: str) -> str:
    if format not in FORMATS:
        raise ValueError(f"format is one of {', '.join(FORMATS)}; got {format!r}")
    return format


def info_json(program: ExportedProgram) -> str:
    """The program's ExportInfo as JSON (empty object for a program amp_graph did not make)."""
    info: ExportInfo | None = program.graph_module.meta.get(INFO)
    if info is None:
        return "{}"
    return json.dumps(
        {
            "policy": info.policy.name,
            "policy_data": _policy_data(info.policy),
            "dtype": short(info.dtype),
            "demoted": info.demoted,
            "stored_low": {k: short(v) for k, v in info.stored_low.items()},
            "islands": [asdict(island) for island in info.islands],
            "casts": info.casts,
        }
    )


def _policy_data(policy: Policy) -> dict[str, Any]:
    """The whole policy, overrides included, as :func:`policy_from_data` reads it back; a
    policy holding code (an fp8 module_filter) says so in place of its data."""
    try:
        return policy_as_data(policy)
    except PolicyNotData as error:
        return {"not_data": str(error)}


def save(
    program: ExportedProgram, path: str | Path, format: str = "pt2", *, check: bool = True
) -> Path:
    """Write ``program`` to ``path`` in ``format``: ``"pt2"`` (``torch.export.save``, with
    the ExportInfo as an extra file), ``"aoti"`` (AOTInductor compiles it for the program's
    device with this machine's compiler: a ``.pt2`` package), or ``"onnx"`` (the program
    through ``torch.onnx.export``; ``check`` then opens it with onnxruntime's CPU provider
    and raises :class:`TargetError` where a kernel is missing).
    """
    check_format(format)
    path = Path(path)
    if format == "pt2":
        torch.export.save(program, path, extra_files={INFO_FILE: info_json(program)})
    elif format == "aoti":
        if path.suffix != ".pt2":
            raise ValueError(f"an AOTInductor package is a .pt2 file; got {str(path)!r}")
        torch._inductor.aoti_compile_and_package(program, package_path=str(path))
    else:
        from .onnx_target import write_onnx

        write_onnx(program, path, info_json(program), check=check)
    return path


def load(path: str | Path, format: str = "pt2") -> Callable[..., Any]:
    """A callable taking the model's arguments, running what :func:`save` wrote."""
    check_format(format)
    if format == "pt2":
        return torch.export.load(str(path)).module()
    if format == "aoti":
        return torch._inductor.aoti_load_package(str(path))
    from .onnx_target import OnnxRunner

    return OnnxRunner(path)


def load_info(path: str | Path, format: str = "pt2") -> dict[str, Any]:
    """The ExportInfo :func:`save` kept in a ``.pt2`` or ONNX file, as a dict."""
    check_format(format)
    if format == "pt2":
        extra = {INFO_FILE: ""}
        torch.export.load(str(path), extra_files=extra)
        return json.loads(extra[INFO_FILE] or "{}")
    if format == "onnx":
        from .onnx_target import onnx_metadata

        return json.loads(onnx_metadata(path).get(INFO_FILE, "{}"))
    raise ValueError("an AOTInductor package keeps no ExportInfo: read it from the .pt2")
