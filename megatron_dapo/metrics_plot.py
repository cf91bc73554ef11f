"""A run's metrics.jsonl drawn as one PNG: a grid with a panel per metric, curves against the step.

Metrics named with a shared prefix ("time/rollout", "time/train", ...) share a panel. The command
line is tools/plot_metrics.py.
"""

from __future__ import annotations

import math
from pathlib import Path

from megatron_dapo.metrics_log import RESERVED, read_metrics

COLUMNS = 4


def panels(records: list[dict]) -> dict[str, list[str]]:
    """Panel title -> the metric names drawn in it, in the order the names first appear."""
    groups: dict[str, list[str]] = {}
    for record in records:
        for key in record:
            if key in RESERVED:
                continue
            title = key.split("/", 1)[0] if "/" in key else key
            names = groups.setdefault(title, [])
            if key not in names:
                names.append(key)
    return groups


def plot_metrics(jsonl_path, out_png, title: str | None = None) -> Path:
    """Write the PNG of every metric in `jsonl_path`; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(jsonl_path)
    groups = panels(records)
    if not groups:
        raise ValueError(f"{jsonl_path}: the records hold a step but no metrics to plot")
    rows = math.ceil(len(groups) / COLUMNS)
    cols = min(COLUMNS, len(groups))
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.8 * rows), squeeze=False)
    for ax, (panel, names) in zip(axes.flat, groups.items()):
        for name in names:
            points = [(r["step"], r[name]) for r in records if r.get(name) is not None]
            steps, values = zip(*points)
            label = name.split("/", 1)[1] if "/" in name else name
            ax.plot(steps, values, marker="o" if len(points) < 30 else None, markersize=3, label=label)
        ax.set_title(panel, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if len(names) > 1 or "/" in names[0]:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    fig.suptitle(title or str(Path(jsonl_path).parent.name or jsonl_path))
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
