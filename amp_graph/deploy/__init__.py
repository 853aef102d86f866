"""Deployment: the mixed-precision inference program (:func:`export`) and its three targets
(:func:`save` / :func:`load`: ``.pt2``, AOTInductor, ONNX)."""

from .program import ExportInfo, Island, export, export_info
from .targets import FORMATS, OnnxStats, TargetError, load, load_info, onnx_stats, save

__all__ = [
    "FORMATS",
    "ExportInfo",
    "Island",
    "OnnxStats",
    "TargetError",
    "export",
    "export_info",
    "load",
    "load_info",
    "onnx_stats",
    "save",
]
