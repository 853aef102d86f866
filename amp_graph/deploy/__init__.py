"""Deployment: the mixed-precision inference program (:func:`export`) and its three targets
(:func:`save` / :func:`load`: ``.pt2``, AOTInductor, ONNX)."""

from .onnx_errors import TargetError
from .program import ExportInfo, Island, export, export_info
from .targets import FORMATS, load, load_info, save

__all__ = [
    "FORMATS",
    "ExportInfo",
    "Island",
    "TargetError",
    "export",
    "export_info",
    "load",
    "load_info",
    "save",
]
