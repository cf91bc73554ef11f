"""The DAPO paper's ablation on our own task: naive GRPO, then each of DAPO's components added in the paper's order,
and GRPO with its KL term beside them; seeds side by side.

The task and model are the demo's (`megatron-dapo demo --task`): "chain" (sums of 2 to 10 numbers worked line by
line, 11 to 77 tokens, the limit 80 with the soft punishment over its last 24: length, truncation and entropy can
move) or "sums" (two-digit sums answered in 6 to 7 tokens), a tiny Qwen2 warm-started to about a third right, the
Megatron policy on one CPU process, the in-process engine, math-verify, the demo's optimizer and batch (32 prompts
x 8 responses, 2 updates a step). The arms (`algorithm.preset` grpo, then overrides):

    GRPO + KL             preset grpo as DeepSeekMath defines it: eps 0.2 / 0.2, sample-level loss, no length
                          treatment, every group trained on, KL (k3, beta 0.04) to the initial policy. Beside the
                          chain: the paper's baseline has no KL term, and neither has DAPO
    naive GRPO            the same without the KL term: where the chain starts
    + overlong filtering  algorithm.overlong_filter: truncated responses left out of the loss
    + clip-higher         loss.eps_high 0.28
    + soft punishment     algorithm.overlong_penalty (Eq. 13 over the task's interval) in place of the filter (DAPO's
                          recipe has the punishment, not the filter)
    + token-level loss    loss.aggregation token
    + dynamic sampling    algorithm.dynamic_sampling (oversample 1.5, up to 4 rounds): DAPO, checked equal to preset
                          dapo switch for switch

Every run generates the same number of samples (the budget: --steps x 32 x 8): an arm with dynamic sampling
pays for the groups it drops with fewer steps. Each run is a process of its own; the seed sets the data order and
the sampling (the warm model is the same for all). Printed: held-out avg@4 / pass@4 on the 256 held-out problems
at the end (temperature 1), the training accuracy, the entropy of the policy on every token it generated (kept or
dropped: the same tokens in every arm; the in-process engine reports it) at the start and end of training, the
response length and the share truncated, the measured share of groups without contrast (all right or all wrong:
dropped with dynamic sampling, trained on at advantage 0 or the penalty's alone without), samples generated per
sample trained on, steps and training time. The figure: a panel per metric, every arm in each (the mean over
seeds against samples generated).

    python bench/ablation.py [--task chain] [--seeds 0 1 2] [--steps 40] [--out /tmp/ablation] [--task-dir DIR]
                             [--limit MAX_RESPONSE_LEN OVERLONG_CACHE_LEN]   # another response limit
    python bench/ablation.py --quick     # 1 seed, 1 step's samples of 8 x 8, 8 held-out problems, in this
                                         # process: the suite's check
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

NAIVE_GRPO = {"algorithm.preset": "grpo", "loss.kl_coef": 0.0}


def limits(task: str, limit: tuple[int, int] | None) -> tuple[int, int]:
    """(algorithm.max_response_len, algorithm.overlong_cache_len): `limit` (--limit), else the task's."""
    from megatron_dapo.demo.tasks import demo_task

    spec = demo_task(task)
    return tuple(limit) if limit else (spec.max_response_len, spec.overlong_cache_len)


def arms(task: str, limit: tuple[int, int] | None = None) -> list[tuple[str, dict[str, object]]]:
    """Each arm's name and every switch it sets (config overrides, section.key -> value): GRPO with its KL term,
    then the paper's chain, each arm the one before it and one component more. `limit`: as limits()."""
    max_response_len, cache_len = limits(task, limit)
    chain = [
        ("naive GRPO", {}),
        ("+ overlong filtering", {"algorithm.overlong_filter": True}),
        ("+ clip-higher", {"loss.eps_high": 0.28}),
        ("+ soft punishment", {"algorithm.overlong_filter": False, "algorithm.overlong_penalty": True,
                               "algorithm.overlong_cache_len": cache_len}),
        ("+ token-level loss", {"loss.aggregation": "token"}),
        ("+ dynamic sampling", {"algorithm.dynamic_sampling": True, "algorithm.oversample_factor": 1.5}),
    ]
    base = {"algorithm.max_response_len": max_response_len}
    merged, out = {**NAIVE_GRPO, **base}, [("GRPO + KL", {"algorithm.preset": "grpo", **base})]
    for name, switches in chain:
        merged = {**merged, **switches}
        out.append((name, merged))
    return out


def arm_overrides(task: str, index: int, limit: tuple[int, int] | None = None) -> list[str]:
    """The `section.key=value` overrides of arm `index`."""
    return [f"{key}={json.dumps(value)}" for key, value in arms(task, limit)[index][1].items()]


# --quick: the suite's check that every arm runs and the table prints, nothing to read in its numbers.
QUICK = {"batch_size": 8, "eval_prompts": 8, "steps": 1, "reward_workers": 1}


def run_config(task: str, folder: Path, run_dir: Path, index: int, seed: int, quick: bool,
               limit: tuple[int, int] | None = None):
    """Arm `index`'s config: the demo's DAPO phase for `task` (made in `folder`) with the arm's switches."""
    from megatron_dapo.demo import dapo_config, without_recipe
    from megatron_dapo.run_config import config_from_dict

    data = without_recipe(dapo_config(folder, folder / "warm", run_dir, seed, task=task))  # the arms set the recipe
    data["parallel"] = {**data["parallel"], "seed": seed}
    data["train"] = {**data["train"], "checkpoint_every": 0, "tensorboard": False}
    data["eval"] = {**data["eval"], "every": 0}
    if quick:
        data["algorithm"] = {**data["algorithm"], "batch_size": QUICK["batch_size"]}
        data["eval"]["max_prompts"] = QUICK["eval_prompts"]
        data["reward"] = {**data["reward"], "num_workers": QUICK["reward_workers"]}
    return config_from_dict(data, arm_overrides(task, index, limit))


def run_arm(task: str, folder: Path, run_dir: Path, index: int, seed: int, budget: int, quick: bool,
            limit: tuple[int, int] | None = None) -> dict:
    """Train arm `index` until `budget` samples are generated, then evaluate (in a child process of its own, or
    in this one with --quick)."""
    from megatron_dapo.parallel.runtime import free_port
    from megatron_dapo.trainer import DapoTrainer

    cfg = run_config(task, folder, run_dir, index, seed, quick, limit)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    trainer = DapoTrainer(cfg)
    curve, generated = [], 0
    try:
        before = trainer.evaluate() if index == 0 else {}
        start = time.perf_counter()
        while generated < budget:
            m = trainer.step()
            generated += int(m["samples_generated"])
            curve.append({"samples": generated, "accuracy": m["accuracy"],
                          "entropy": m.get("rollout_entropy", math.nan), "response_len": m["response_len_mean"],
                          "truncation": m["truncation_rate"], "no_contrast": m["filter_rate"],
                          "trained": int(m["groups_kept"]) * cfg.algorithm.group_size})
        train_s = time.perf_counter() - start
        after = trainer.evaluate()
    finally:
        trainer.close()
    k = cfg.eval.samples_per_prompt
    return {"curve": curve, "train_s": train_s, "k": k, "avg": after[f"eval/avg@{k}"], "pass": after[f"eval/pass@{k}"],
            "before": {key.split("/")[1]: v for key, v in before.items()}}


def prepare(task: str, folder: Path) -> Path:
    """The demo's task `task` and its warm model, made once in `folder`."""
    from megatron_dapo.demo import warm_task

    if not (folder / "warm" / "config.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        warm_task(folder, seed=0, task=task)
    return folder


def check_last_arm_is_dapo(task: str, folder: Path, out: Path, limit: tuple[int, int] | None = None) -> None:
    """The chain's end is preset dapo, switch for switch."""
    from megatron_dapo.algorithm.presets import PRESETS
    from megatron_dapo.demo import dapo_config
    from megatron_dapo.run_config import config_from_dict

    last = run_config(task, folder, out / "check", len(arms(task)) - 1, 0, quick=False, limit=limit)
    data = dapo_config(folder, folder / "warm", out / "check", 0, task=task)  # the demo's recipe: DAPO's
    max_response_len, cache_len = limits(task, limit)
    dapo = config_from_dict({**data, "algorithm": {**data["algorithm"], "preset": "dapo",
                                                   "max_response_len": max_response_len,
                                                   "overlong_cache_len": cache_len}})
    for key in PRESETS["dapo"]:
        section, name = key.split(".")
        mine, theirs = getattr(getattr(last, section), name), getattr(getattr(dapo, section), name)
        if mine != theirs:
            raise SystemExit(f"the last arm is not DAPO: {key} is {mine!r}, preset dapo's {theirs!r}")


def run_child(task: str, folder: Path, out: Path, index: int, seed: int, budget: int,
              limit: tuple[int, int] | None = None) -> dict:
    run_dir = out / f"arm{index}_seed{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, __file__, "--task", task, "--task-dir", str(folder), "--out", str(out), "--arm",
           str(index), "--seed", str(seed), "--budget", str(budget)]
    if limit:
        cmd += ["--limit", *map(str, limit)]
    with open(run_dir / "log.txt", "w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "2"})
    if done.returncode:
        raise SystemExit(f"arm {arms(task)[index][0]!r} seed {seed} failed ({done.returncode}):\n"
                         + (run_dir / "log.txt").read_text()[-4000:])
    return json.loads((run_dir / "result.json").read_text())


def mean_sd(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    m = scale * statistics.fmean(values)
    if len(values) < 2:
        return f"{m:.{digits}f}"
    return f"{m:.{digits}f} ± {scale * statistics.stdev(values):.{digits}f}"


def quarter_mean(curve: list[dict], key: str, last: bool) -> float:
    n = max(1, len(curve) // 4)
    part = curve[-n:] if last else curve[:n]
    return statistics.fmean(p[key] for p in part)


def print_table(names: list[str], results: dict[int, list[dict]], before: dict, budget: int) -> None:
    k = next(iter(results.values()))[0]["k"]
    print(f"\nwarm model: held-out avg@{k} {100 * before[f'avg@{k}']:.1f} %, pass@{k} {100 * before[f'pass@{k}']:.1f} %; "
          f"{budget} samples generated per run; mean ± sd over {len(next(iter(results.values())))} seed(s)")
    print(f"| arm | avg@{k} % | pass@{k} % | train acc. % (last 25%) | entropy of generated tokens, first 25% -> "
          "last 25% | response len (last 25%) | truncated % (last 25%) | groups without contrast % | "
          "samples / trained sample | steps | train s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for index, runs in results.items():
        curves = [r["curve"] for r in runs]
        print(f"| {names[index]} | {mean_sd([r['avg'] for r in runs], 100)} | {mean_sd([r['pass'] for r in runs], 100)}"
              f" | {mean_sd([quarter_mean(c, 'accuracy', True) for c in curves], 100)}"
              f" | {mean_sd([quarter_mean(c, 'entropy', False) for c in curves], 1, 3)} -> "
              f"{mean_sd([quarter_mean(c, 'entropy', True) for c in curves], 1, 3)}"
              f" | {mean_sd([quarter_mean(c, 'response_len', True) for c in curves])}"
              f" | {mean_sd([quarter_mean(c, 'truncation', True) for c in curves], 100)}"
              f" | {mean_sd([statistics.fmean(p['no_contrast'] for p in c) for c in curves], 100)}"
              f" | {statistics.fmean(c[-1]['samples'] / max(1, sum(p['trained'] for p in c)) for c in curves):.2f}"
              f" | {mean_sd([len(c) for c in curves])} | {mean_sd([r['train_s'] for r in runs])} |")


PANELS = [("accuracy", "training accuracy"), ("entropy", "entropy of generated tokens (nats / token)"),
          ("response_len", "response length (tokens)"), ("truncation", "share truncated"),
          ("no_contrast", "share of groups without contrast")]


def plot(names: list[str], results: dict[int, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, grid_axes = plt.subplots(2, 3, figsize=(16, 9))
    axes, legend_ax = list(grid_axes.flat[:len(PANELS)]), grid_axes.flat[len(PANELS)]
    for index, runs in results.items():
        end = min(r["curve"][-1]["samples"] for r in runs)
        grid = np.linspace(min(r["curve"][0]["samples"] for r in runs), end, 50)
        for ax, (key, _) in zip(axes, PANELS):
            ys = [np.interp(grid, [p["samples"] for p in r["curve"]], [p[key] for p in r["curve"]]) for r in runs]
            ax.plot(grid, np.mean(ys, axis=0), marker="o", markevery=[-1], label=names[index])
    for ax, (_, title) in zip(axes, PANELS):
        ax.set_xlabel("samples generated")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    legend_ax.axis("off")
    legend_ax.legend(*axes[0].get_legend_handles_labels(), loc="center", title="arm (mean over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    from megatron_dapo.demo.tasks import TASKS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=list(TASKS), default="chain")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=40, help="the budget in steps of the demo's batch (32 x 8)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/ablation"))
    parser.add_argument("--task-dir", type=Path, help="a folder with the task's train.jsonl, eval.jsonl and warm/ "
                        "(default: made in --out)")
    parser.add_argument("--quick", action="store_true", help="1 seed, 1 step's samples of 8 x 8, 8 held-out problems")
    parser.add_argument("--limit", type=int, nargs=2, metavar=("MAX_RESPONSE_LEN", "OVERLONG_CACHE_LEN"),
                        help="the response limit and the soft punishment's interval, instead of the task's")
    parser.add_argument("--arm", type=int, help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm is not None:
        result = run_arm(args.task, args.task_dir, args.out / f"arm{args.arm}_seed{args.seed}" / "run", args.arm,
                         args.seed, args.budget, quick=False, limit=args.limit)
        (args.out / f"arm{args.arm}_seed{args.seed}" / "result.json").write_text(json.dumps(result))
        return 0

    from megatron_dapo.demo import DAPO

    seeds, steps = ([args.seeds[0]], QUICK["steps"]) if args.quick else (args.seeds, args.steps)
    batch = QUICK["batch_size"] if args.quick else DAPO["algorithm"]["batch_size"]
    args.out.mkdir(parents=True, exist_ok=True)
    folder = args.task_dir or prepare(args.task, args.out / f"task-{args.task}")
    check_last_arm_is_dapo(args.task, folder, args.out, args.limit)
    names = [name for name, _ in arms(args.task)]
    budget = steps * batch * DAPO["algorithm"]["group_size"]
    max_response_len, cache_len = limits(args.task, args.limit)
    print(f"task {args.task}: responses up to {max_response_len} tokens, the soft punishment over the last "
          f"{cache_len}", flush=True)
    results: dict[int, list[dict]] = {i: [] for i in range(len(names))}
    before = {}
    start = time.perf_counter()
    for seed in seeds:  # seed-major: a cut-short run still has every arm of its first seeds
        for index in range(len(names)):
            # The full run gives each arm a process of its own (no heap or allocator state carried into the next
            # one's timing); the quick one runs them here, one after another, at half the start-up cost.
            r = (run_arm(args.task, folder, args.out / f"arm{index}_seed{seed}" / "run", index, seed, budget, True,
                         args.limit)
                 if args.quick else run_child(args.task, folder, args.out, index, seed, budget, args.limit))
            results[index].append(r)
            before = before or r["before"]
            print(f"seed {seed} {names[index]}: avg@{r['k']} {100 * r['avg']:.1f} %, {len(r['curve'])} steps, "
                  f"{r['train_s']:.0f} s", flush=True)
    print_table(names, results, before, budget)
    plot(names, results, args.out / "ablation.png")
    print(f"\nfigure: {args.out / 'ablation.png'}; total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
