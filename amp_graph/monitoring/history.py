"""The monitor's table: one row per (step, node, role), and the files it is written to.

Each row names what was measured (``step``, ``node``, ``module``, ``op``, ``role``,
``dtype``, ``run_dtype``, ``backward``) and holds the statistics the monitor computed:
``amax`` and ``nonfinite`` as they are (a magnitude, a count), every other statistic as a
fraction of ``numel``, the elements measured in that step (summed over micro-batches).
"""

from __future__ import annotations

import csv
import html
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from amp_graph.ops.tensor_stats import STATS
from amp_graph.passes.meta import short

# what names a row, then the statistics in STATS order
KEY_COLUMNS = (
    "step",
    "node",
    "module",
    "op",
    "role",
    "dtype",
    "run_dtype",
    "backward",
    "loss_scale",  # the scale the step's backward ran at (gradients are measured so); or None
    "rank",  # the process measured (0 alone); None: reduced over the monitor's group
)
COUNTS = frozenset({"amax", "nonfinite", "numel"})  # kept as they are, not as fractions


def make_row(
    probe: Any,
    step: int,
    values: Sequence[float],
    stats: Sequence[str],
    loss_scale: float | None = None,
    rank: int | None = 0,
) -> dict:
    """A row from a probe (:class:`amp_graph.passes.instrument.Probe`) and its buffer row."""
    numel = values[STATS.index("numel")]
    row: dict[str, Any] = {
        "step": step,
        "node": probe.where,
        "module": probe.module,
        "op": probe.op,
        "role": probe.role,
        "dtype": short(probe.dtype),
        "run_dtype": short(probe.run_dtype),
        "backward": probe.backward,
        "loss_scale": loss_scale,
        "rank": rank,
    }
    for name in stats:
        value = values[STATS.index(name)]
        row[name] = value if name in COUNTS else value / numel
    row["numel"] = int(numel)
    return row


class History:
    """Rows of the monitor's statistics (see the module), oldest first: by step, then in the
    order the step computed what they measure (every forward probe in graph order, then the
    backward ones in reverse graph order; :func:`amp_graph.passes.instrument.computed_order`).

    ``history.where(role="output", step=100)`` filters; ``history.column("underflow")`` is
    one statistic; ``to_csv`` / ``to_jsonl`` write it; in a notebook it shows as a table.
    """

    def __init__(self, rows: Sequence[dict], stats: Sequence[str]) -> None:
        self.rows = list(rows)
        self.stats = tuple(stats)

    @property
    def columns(self) -> tuple[str, ...]:
        return (*KEY_COLUMNS, *self.stats, "numel")

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[dict]:
        return iter(self.rows)

    def __getitem__(self, index: int) -> dict:
        return self.rows[index]

    @property
    def steps(self) -> list[int]:
        return sorted({row["step"] for row in self.rows})

    def where(self, **equal: Any) -> History:
        """The rows whose columns equal the given values (``node="linear.output"``)."""
        unknown = set(equal) - set(self.columns)
        if unknown:
            raise ValueError(f"History has no column {sorted(unknown)}; columns: {self.columns}")
        rows = [r for r in self.rows if all(r[k] == v for k, v in equal.items())]
        return History(rows, self.stats)

    def column(self, name: str) -> list[Any]:
        if name not in self.columns:
            raise ValueError(f"History has no column {name!r}; columns: {self.columns}")
        return [row[name] for row in self.rows]

    def first_nonfinite(self) -> dict | None:
        """The first row with an inf or nan, or None: by step, then in the order the step
        computed the values (the forward in graph order, then the backward in reverse graph
        order, as autograd runs it). The rows are kept in that order."""
        if "nonfinite" not in self.stats:
            raise ValueError("the monitor does not count non-finite values (stats= lacks it)")
        return next((r for r in self.rows if r["nonfinite"]), None)

    def to_csv(self, path: str | Path) -> None:
        write_csv(Path(path), self.rows, self.columns, append=False)

    def to_jsonl(self, path: str | Path) -> None:
        write_jsonl(Path(path), self.rows, append=False)

    def __repr__(self) -> str:
        steps = self.steps
        span = f"steps {steps[0]}..{steps[-1]}" if steps else "no steps yet"
        nodes = len({row["node"] for row in self.rows})
        return f"History({len(self.rows)} rows, {nodes} probes, {span})"

    def _repr_html_(self, limit: int = 60) -> str:
        shown = self.rows[-limit:]
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        body = "".join(
            "<tr>"
            + "".join(f"<td>{html.escape(_text(row[c]))}</td>" for c in self.columns)
            + "</tr>"
            for row in shown
        )
        more = (
            f"<p>last {len(shown)} of {len(self.rows)} rows</p>" if len(self.rows) > limit else ""
        )
        return f"<p>{html.escape(repr(self))}</p>{more}<table><tr>{head}</tr>{body}</table>"


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def write_csv(path: Path, rows: Sequence[dict], columns: Sequence[str], *, append: bool) -> None:
    new = not (append and path.exists())
    with path.open("w" if new else "a", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(columns))
        if new:
            writer.writeheader()
        writer.writerows(rows)


def write_jsonl(path: Path, rows: Sequence[dict], *, append: bool) -> None:
    with path.open("a" if append else "w") as file:
        for row in rows:
            file.write(json.dumps(row) + "\n")
