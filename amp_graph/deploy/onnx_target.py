"""The ONNX target: ``torch.onnx.export`` of an exported program, its file's statistics,
and onnxruntime running it on the CPU (the ``onnx`` extra: onnx, onnxscript, onnxruntime;
this module is imported only when a program is written to or read from ONNX).

A missing kernel or an op type ONNX does not define for a low dtype is a
:class:`TargetError` naming the op, the dtype and the node, never a silent change of dtype.
"""

from __future__ import annotations

import logging
import re
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram

from .onnx_errors import TargetError

log = logging.getLogger(__name__)

ONNX_PROVIDER = "CPUExecutionProvider"
INFO_KEY = "amp_graph.json"


def write_onnx(program: ExportedProgram, path: Path, info: str, *, check: bool) -> None:
    """``program`` as one ONNX file (weights inside) with ``info`` in its metadata; with
    ``check``, opened by onnxruntime's CPU provider (a :class:`TargetError` where it cannot
    run it; a WARNING where it runs some low-precision ops in float32)."""
    onnx_program(program).save(str(path), external_data=False)
    _add_onnx_info(path, info)
    if check:
        file_casts = _casts(_require_onnx().load(str(path), load_external_data=False))
        added = _runtime_casts(path) - file_casts  # opening it is the check
        if added > 0:
            log.warning(
                "amp_graph: onnxruntime's CPU provider runs %s with %d more casts than the "
                "file has: it computes the low-precision ops it has no kernel for (float16 "
                "MatMul on x86, for one) in float32, and casts around them. The file keeps "
                "them low for runtimes that have the kernels (onnxruntime's CUDA provider); "
                "for low-precision speed on this CPU use format 'pt2' or 'aoti' "
                "(amp_graph.deploy.onnx_target.onnx_stats(path).runtime_casts counts them).",
                path,
                added,
            )


def onnx_metadata(path: str | Path) -> dict[str, str]:
    onnx = _require_onnx()
    model = onnx.load(str(path), load_external_data=False)
    return {p.key: p.value for p in model.metadata_props}


def _require_onnx() -> Any:
    try:
        import onnx
    except ImportError:
        raise ImportError(
            "the ONNX target needs the onnx extra: pip install 'amp_graph[onnx]' "
            "(onnx, onnxscript, onnxruntime)"
        ) from None
    return onnx


def onnx_program(program: ExportedProgram) -> Any:
    """``torch.onnx.export`` of the program (its dynamic sizes kept): an ``ONNXProgram``.

    torch.onnx optimizes the ONNX graph it writes, and one of its rewrites is wrong for
    mixed precision: it folds a batch norm whose parameters are float32 into the float16
    convolution before it, giving the ``Conv`` a float32 bias, which no runtime accepts
    (ONNX binds one type to all of Conv's inputs). Where ONNX's own checker finds the
    optimized graph ill-typed, the program is exported again without that optimization
    (the same ops and dtypes as the program; more nodes), and the log says so.
    """
    onnx = _require_onnx()
    exported = torch.onnx.export(program, dynamo=True, verbose=False)
    try:
        onnx.checker.check_model(exported.model_proto, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as error:
        log.info("torch.onnx's optimized graph is ill-typed (%s); exporting it unoptimized", error)
        return torch.onnx.export(program, dynamo=True, verbose=False, optimize=False)
    return exported


def _add_onnx_info(path: Path, info: str) -> None:
    onnx = _require_onnx()
    model = onnx.load(str(path))
    entry = model.metadata_props.add()
    entry.key, entry.value = INFO_KEY, info
    onnx.save(model, str(path))


@dataclass(frozen=True)
class OnnxStats:
    """What an ONNX file holds: ``casts`` (Cast nodes), ``initializers`` (count per dtype
    name: low-precision weights stay low rather than float32 plus a Cast), and
    ``runtime_casts``: the Cast nodes of the graph onnxruntime's CPU provider runs, which
    casts to float32 and back, itself, around each float16 op it has no kernel for (x86's
    ``MatMul``, for one): more than ``casts`` means it computes some in float32."""

    casts: int
    nodes: int
    initializers: dict[str, int]
    runtime_casts: int


def onnx_stats(path: str | Path) -> OnnxStats:
    onnx = _require_onnx()
    model = onnx.load(str(path))
    names = _dtype_names(onnx)
    kinds = Counter(names[i.data_type] for i in model.graph.initializer)
    return OnnxStats(_casts(model), len(model.graph.node), dict(kinds), _runtime_casts(path))


def _dtype_names(onnx: Any) -> dict[int, str]:
    """ONNX's element types by number: ``{10: "float16", 16: "bfloat16", ...}``."""
    return {v: k.lower() for k, v in onnx.TensorProto.DataType.items()}


def _casts(model: Any) -> int:
    return sum(n.op_type == "Cast" for n in model.graph.node)


def _runtime_casts(path: str | Path) -> int:
    """The Cast nodes of the graph onnxruntime's CPU provider runs (its optimized model)."""
    onnx = _require_onnx()
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3  # not its warning that the saved graph is this CPU's
    with tempfile.TemporaryDirectory() as folder:
        options.optimized_model_filepath = str(Path(folder) / "optimized.onnx")
        _onnx_session(Path(path), options)
        return _casts(onnx.load(options.optimized_model_filepath))


_MISSING = re.compile(r"implementation for (\w+)\((\d+)\) node with name '([^']*)'")
# ONNX's own operator schemas: bfloat16 is not among Conv's types, for one
_INVALID_TYPE = re.compile(
    r"Type 'tensor\((\w+)\)' of input parameter \(.*?\) of operator \((\w+)\) in node "
    r"\(([^)]*)\) is invalid"
)


def _onnx_session(path: Path, options: Any = None) -> Any:
    """An onnxruntime session on the CPU provider; a missing kernel is a TargetError naming
    the op, its input dtype and the node."""
    _require_onnx()
    import onnxruntime

    try:
        return onnxruntime.InferenceSession(str(path), options, providers=[ONNX_PROVIDER])
    except Exception as error:  # onnxruntime raises its own classes, per build
        if invalid := _INVALID_TYPE.search(str(error)):
            dtype, op, node = invalid.groups()
            raise TargetError(
                f"ONNX's {op} does not take {dtype} inputs (node {node!r}): this {dtype} "
                f"program cannot be run in format 'onnx'. Export with dtype=torch.float16, "
                f"keep {op} in float32 (a policy override), or use format 'pt2' or 'aoti'"
            ) from None
        found = _MISSING.search(str(error))
        if found is None:
            raise
        op, _, node = found.groups()
        dtype = _onnx_input_dtype(path, node)
        raise TargetError(
            f"onnxruntime's {ONNX_PROVIDER} has no {dtype} kernel for {op} (ONNX node "
            f"{node!r}): it cannot run this {dtype} program in format 'onnx'. Export with "
            "dtype=torch.float16 (it runs float16 files, computing in float32, with casts "
            "of its own, the ops it has no float16 kernel for: onnx_stats(path).runtime_casts "
            "counts them), keep that op in float32 (a policy override), use format 'pt2' or "
            "'aoti', or run the file on a provider with those kernels (save(..., "
            "check=False) writes it unchecked)"
        ) from None


def _onnx_input_dtype(path: Path, node_name: str) -> str:
    onnx = _require_onnx()
    model = onnx.shape_inference.infer_shapes(onnx.load(str(path)))
    graph = model.graph
    types = {
        v.name: v.type.tensor_type.elem_type
        for v in [*graph.value_info, *graph.input, *graph.output]
    }
    types.update({i.name: i.data_type for i in graph.initializer})
    names = _dtype_names(onnx)
    node = next((n for n in graph.node if n.name == node_name), None)
    if node is None:
        return "low-precision"
    found = [names.get(types[i], "?") for i in node.input if i in types]
    return found[0] if found else "low-precision"


class OnnxRunner:
    """An ONNX file run by onnxruntime on the CPU, called with the model's arguments (their
    tensors, in order, are the ONNX inputs) and returning torch tensors."""

    def __init__(self, path: str | Path) -> None:
        self.session = _onnx_session(Path(path))
        self.inputs = [i.name for i in self.session.get_inputs()]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tensors = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
        if len(tensors) != len(self.inputs):
            raise TypeError(
                f"the ONNX model takes {len(self.inputs)} tensors ({', '.join(self.inputs)}); "
                f"got {len(tensors)}"
            )
        pairs = zip(self.inputs, tensors, strict=True)
        feed = {name: t.detach().cpu().numpy() for name, t in pairs}
        outputs = [torch.from_numpy(o) for o in self.session.run(None, feed)]
        return outputs[0] if len(outputs) == 1 else tuple(outputs)
