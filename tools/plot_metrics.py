#!/usr/bin/env python3
"""Draw a run's metrics.jsonl as one PNG: a grid with a panel per metric, curves against the step.

    python tools/plot_metrics.py RUN_DIR/metrics.jsonl -o curves.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_dapo.observability.metrics_plot import plot_metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", help="a run's metrics.jsonl")
    parser.add_argument("-o", "--output", help="PNG to write (default: metrics.png beside the input)")
    parser.add_argument("--title", help="figure title (default: the run folder's name)")
    args = parser.parse_args(argv)
    out = args.output or Path(args.metrics).with_suffix(".png")
    try:
        path = plot_metrics(args.metrics, out, title=args.title)
    except (FileNotFoundError, ValueError) as e:
        print(f"plot_metrics: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
