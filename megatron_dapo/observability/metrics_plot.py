"""A run's metrics.jsonl drawn as one PNG: a grid of panels, curves against the step.

The curves a person looks for first come first (KEY_PANELS: accuracy and reward, the held-out evaluation,
response length, entropy, clip fractions, grad norm, the step's time split); the rest follow in panels by what
they tell (OTHER_PANELS), and a metric neither names gets a panel of its own, shared with the metrics of its
prefix ("custom/a", "custom/b"). A metric that never changes in the run (groups
aborted in a run that aborts none, ...) is not drawn: the line under the figure lists it with its value. The
command line is tools/plot_metrics.py.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

from megatron_dapo.observability.metrics_log import RESERVED, read_metrics

COLUMNS = 4

# Panel title -> what it draws: metric names, or prefixes ending in "/" (every metric under it). The curves a
# person looks for first, then the others grouped by what they tell, each panel of one scale.
KEY_PANELS = {
    "accuracy and reward": ["accuracy", "reward_mean"],
    "held-out evaluation": ["eval/"],
    "response length": ["response_len_mean", "response_len_max"],
    "entropy": ["entropy", "rollout_entropy"],
    "clip fractions": ["clip_frac/"],
    "grad norm": ["grad_norm"],
    "step time split (s)": ["time/"],
}
OTHER_PANELS = {
    "groups per step": ["groups_generated", "groups_settled", "groups_kept", "groups_all_correct",
                        "groups_all_wrong", "groups_aborted", "groups_trimmed", "groups_stale"],
    "filtered and truncated": ["filter_rate", "filter_rate_all_correct", "filter_rate_all_wrong",
                               "truncation_rate", "round_cap_hit"],
    "sampling effort": ["rounds", "samples_per_kept_sample"],
    "prompts and samples": ["prompts_drawn", "samples_generated", "prompts_too_long", "rollout_buffer"],
    "loss": ["loss"],
    "importance ratio": ["ratio_mean", "ratio_max"],
    "approx KL": ["approx_kl"],
    "learning rate": ["lr"],
    "updates": ["updates", "updates_skipped"],
    "tokens per step": ["batch_tokens", "loss_tokens"],
    "staleness": ["staleness", "staleness/"],
    "engine vs trainer: KL and chi-square": ["mismatch/kl", "mismatch/chi2"],
    "engine vs trainer: |log-ratio|": ["mismatch/abs_mean", "mismatch/abs_max", "mismatch/seq_log_ratio_std"],
    "engine vs trainer: ratios before the correction": ["mismatch/token_ratio_mean", "mismatch/token_ratio_max",
                                                        "mismatch/seq_ratio_mean", "mismatch/seq_ratio_max"],
    "rollout correction: weights and masked shares": ["correction/"],
    "weight version sampled from": ["weight_version"],
    "tokens per second": ["tokens_per_s"],
    "MoE expert load (busiest / mean expert)": ["moe/expert_load/"],
    "MoE expert load by layer": ["moe/expert_load_by_layer/"],
    "MoE load-balancing loss": ["moe/load_balancing_loss"],
    "MoE routing agreement (own top-k = rollout's)": ["moe/routing_agreement", "moe/routing_agreement_by_layer/"],
}
PANELS = {**KEY_PANELS, **OTHER_PANELS}


def _known_panel(name: str) -> str | None:
    for title, members in PANELS.items():
        if any(name == m or (m.endswith("/") and name.startswith(m)) for m in members):
            return title
    return None


def _constant(records: list[dict], name: str) -> float | None:
    """The one value `name` takes in every record that has it, or None if it changes."""
    values = {r[name] for r in records if r.get(name) is not None}
    return values.pop() if len(values) == 1 else None


def panels(records: list[dict]) -> tuple[dict[str, list[str]], dict[str, float]]:
    """(panel title -> the metric names drawn in it, and the metrics left out because they never change -> their
    value). The key panels come first, then the others of PANELS in its order, then a panel per metric PANELS does
    not know (or per prefix before a "/") in the order they first appear. A metric with a single record is drawn:
    one point does not show that it never changes."""
    names: list[str] = []
    for record in records:
        names += [key for key in record if key not in RESERVED and key not in names]
    counts = {name: sum(r.get(name) is not None for r in records) for name in names}
    flat = {name: value for name in names
            if counts[name] > 1 and (value := _constant(records, name)) is not None}
    groups: dict[str, list[str]] = {title: [] for title in PANELS}
    for name in names:
        if name in flat:
            continue
        title = _known_panel(name) or (name.split("/", 1)[0] if "/" in name else name)
        groups.setdefault(title, []).append(name)
    return {title: members for title, members in groups.items() if members}, flat


def _flat_line(flat: dict[str, float]) -> str:
    return "not drawn, the same at every step: " + ", ".join(f"{name} = {value:g}" for name, value in flat.items())


def plot_metrics(jsonl_path, out_png, title: str | None = None) -> Path:
    """Write the PNG of `jsonl_path`'s metrics; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(jsonl_path)
    groups, flat = panels(records)
    if not groups and not flat:
        raise ValueError(f"{jsonl_path}: the records hold a step but no metrics to plot")
    rows = max(1, math.ceil(len(groups) / COLUMNS))
    cols = max(1, min(COLUMNS, len(groups)))
    footer = textwrap.wrap(_flat_line(flat), 45 * cols) if flat else []
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.8 * rows + 0.2 * len(footer)), squeeze=False)
    for ax, (panel, names) in zip(axes.flat, groups.items()):
        for name in names:
            points = [(r["step"], r[name]) for r in records if r.get(name) is not None]
            steps, values = zip(*points)
            label = name.split("/", 1)[1] if "/" in name and _known_panel(name) is None else name
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
    bottom = 0.2 * len(footer) / fig.get_figheight()
    if footer:
        fig.text(0.01, 0.005, "\n".join(footer), fontsize=8, va="bottom", ha="left")
    fig.tight_layout(rect=(0, bottom + 0.01 if footer else 0, 1, 1))
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
