"""The error a deployment target raises for what it cannot run (no ONNX import here)."""


class TargetError(RuntimeError):
    """The target cannot run what the program computes: the message names the op, the dtype
    and the target."""
