"""TensorBoard scalars for the monitor's rows (the optional ``amp_graph[tensorboard]`` extra).

Imported only when a monitor writes TensorBoard logs; ``import amp_graph`` never imports
``tensorboard``. One scalar per (node, role, statistic): ``linear_3.output/underflow``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter


class TensorBoardLog:
    def __init__(self, log_dir: Path) -> None:
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, rows: Sequence[dict], stats: Sequence[str]) -> None:
        for row in rows:
            tag = f"{row['node']}.{row['role']}"
            for name in stats:
                self.writer.add_scalar(f"{tag}/{name}", row[name], row["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
