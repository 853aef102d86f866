"""The demo and the fixtures the tests and notebooks share (not part of the library).

* :mod:`~amp_graph.demo.digits_demo` - ``make demo``: a ConvNet trained on scikit-learn's
  digits with ``torch.autocast`` and with amp_graph, side by side;
* :mod:`~amp_graph.demo.digits` - the digits loader;
* :mod:`~amp_graph.demo.models` - small models written the way people write them.
"""

# what `amp_graph.demo` held when it was one module
from .digits_demo import (
    DTYPES,
    FULL,
    LEARNING_RATE,
    QUICK,
    SLOW_LOW_PRECISION,
    WARMUP_STEPS,
    DigitsStep,
    accuracy,
    cpu_low_precision_units,
    eager_step,
    loss_scaling_run,
    low_precision_verdict,
    main,
    optimizer,
    parameter_bytes,
    progress,
    scale_trajectory,
    timed_steps,
)

__all__ = [
    "DTYPES",
    "FULL",
    "LEARNING_RATE",
    "QUICK",
    "SLOW_LOW_PRECISION",
    "WARMUP_STEPS",
    "DigitsStep",
    "accuracy",
    "cpu_low_precision_units",
    "eager_step",
    "loss_scaling_run",
    "low_precision_verdict",
    "main",
    "optimizer",
    "parameter_bytes",
    "progress",
    "scale_trajectory",
    "timed_steps",
]
