"""The capture's error: what amp_graph could not capture, the construct and a way out."""

from __future__ import annotations


class CaptureError(RuntimeError):
    """amp_graph could not capture the model; the message names the construct and a way out."""


__all__ = ["CaptureError"]
