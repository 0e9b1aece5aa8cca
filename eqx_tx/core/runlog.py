"""A training run's record: per-step metrics as JSON lines, and their curve as an SVG.

`MetricsLog` keeps `metrics.jsonl` in a run's directory: one JSON object per row
(its `step`: the 0-based index of the optimizer step),
the file rewritten atomically on every `flush` (a reader never sees half a line), and
on a resumed run the rows from the resumed step on are dropped first (they are
computed again). `write_line_chart` draws series of `(step, value)` points as a small
dependency-free SVG (`loss.svg`, `reward.svg`).
"""

import json
import os
from collections.abc import Mapping, Sequence


class MetricsLog:
    """`path`'s rows before step `start` (a resumed run's history), then what is added."""

    def __init__(self, path: str, *, start: int = 0):
        self.path = path
        self.rows: list[dict] = []
        if start > 0 and os.path.isfile(path):
            with open(path) as f:
                self.rows = [r for r in map(json.loads, f) if r.get("step", 0) < start]

    def add(self, row: Mapping) -> None:
        self.rows.append(dict(row))

    def flush(self) -> None:
        """Write every row (atomically: a temporary file renamed over the old one)."""
        with open(self.path + ".tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in self.rows)
        os.replace(self.path + ".tmp", self.path)

    def series(self, key: str) -> list[tuple[int, float]]:
        """`(step, row[key])` of the rows that have `key`."""
        return [(r["step"], r[key]) for r in self.rows if key in r]


def write_line_chart(path: str, series: Mapping[str, tuple[str, Sequence[tuple[int, float]]]], *, title: str,
                     y_range: tuple[float, float] | None = None) -> None:
    """Draw `{label: (colour, [(step, value), ...])}` as lines over the steps (the y axis
    spans `y_range`, default the values' own range), written atomically to `path`."""
    W, H, pad = 480, 240, 36
    points = [p for _, pts in series.values() for p in pts]
    last = max([s for s, _ in points] + [1])
    values = [v for _, v in points] or [0.0, 1.0]
    low, high = y_range or (min(values), max(values))
    high = high if high > low else low + 1.0

    def xy(s, v):
        return pad + (W - 2 * pad) * s / last, H - pad - (H - 2 * pad) * (min(max(v, low), high) - low) / (high - low)

    def line(pts, colour):
        coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(s, v) for s, v in pts))
        return f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{coords}"/>'

    legend = ", ".join(f"{colour}: {label}" for label, (colour, _) in series.items())
    with open(path + ".tmp", "w") as f:
        f.write(f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-size="11">\n'
                f'<rect width="{W}" height="{H}" fill="white"/>\n'
                f'<line x1="{pad}" y1="{H - pad}" x2="{W - pad}" y2="{H - pad}" stroke="black"/>\n'
                f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{H - pad}" stroke="black"/>\n'
                f'<text x="{pad}" y="{pad - 20}">{title} ({legend})</text>\n'
                f'<text x="{pad}" y="{pad - 6}">{low:.3g} .. {high:.3g} over {last} steps</text>\n'
                + "".join(line(pts, colour) + "\n" for colour, pts in series.values()) + "</svg>\n")
    os.replace(path + ".tmp", path)
