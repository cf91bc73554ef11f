"""The DAPO paper's ablation on our own task: GRPO, then each of DAPO's components added, seeds side by side.

The task and model are the demo's (`megatron-dapo demo`): two-digit sums, a tiny Qwen2 warm-started to about a
third right, the Megatron policy on one CPU process, the in-process engine, math-verify, the demo's optimizer and
batch (32 prompts x 8 responses, 2 updates a step, responses up to 12 tokens). The arms, each adding one switch
to the one before (`algorithm.preset` grpo, then overrides; the last is checked equal to preset dapo):

    GRPO              preset grpo: eps 0.2 / 0.2, sample-level loss, no length treatment, every group trained on,
                      KL (k3, beta 0.04) to the initial policy
    GRPO - KL         loss.kl_coef 0: the paper's baseline has no KL term, and neither has DAPO
    + clip-higher     loss.eps_high 0.28
    + overlong        algorithm.overlong_penalty (soft punishment over the last 4 of the 12 tokens)
    + token-level     loss.aggregation token
    + dyn. sampling   algorithm.dynamic_sampling (oversample 1.5, up to 4 rounds): DAPO

Every run generates the same number of samples (the budget: --steps x 32 x 8): an arm with dynamic sampling
pays for the groups it drops with fewer steps. Each run is a process of its own; the seed sets the data order and
the sampling (the warm model is the same for all). Printed: held-out avg@4 / pass@4 on the 256 held-out problems
at the end (temperature 1), the training accuracy, the policy's entropy at the start and end of training, the
response length, samples generated per sample trained on, steps and training time; a figure of the training
accuracy and entropy against samples generated, per arm (the mean over seeds).

    python bench/ablation.py [--seeds 0 1 2] [--steps 40] [--out /tmp/ablation] [--task DIR]
    python bench/ablation.py --quick     # 1 seed, 2 steps' samples, 32 held-out problems, in this process: the
                                         # suite's check
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

# Each arm: its name and the switches it adds to the arm before it (config overrides, section.key -> value).
ARMS: list[tuple[str, dict[str, object]]] = [
    ("GRPO", {"algorithm.preset": "grpo"}),
    ("GRPO - KL", {"loss.kl_coef": 0.0}),
    ("+ clip-higher", {"loss.eps_high": 0.28}),
    ("+ overlong", {"algorithm.overlong_penalty": True, "algorithm.overlong_cache_len": 4}),
    ("+ token-level", {"loss.aggregation": "token"}),
    ("+ dyn. sampling", {"algorithm.dynamic_sampling": True, "algorithm.oversample_factor": 1.5}),
]
def arm_overrides(index: int) -> list[str]:
    """The `section.key=value` overrides of arm `index`: every switch of the arms up to it."""
    merged: dict[str, object] = {}
    for _, switches in ARMS[: index + 1]:
        merged.update(switches)
    return [f"{key}={json.dumps(value)}" for key, value in merged.items()]


def run_config(task: Path, run_dir: Path, index: int, seed: int, quick: bool):
    """Arm `index`'s config: the demo's DAPO phase with the arm's switches."""
    from megatron_dapo.demo import dapo_config, without_recipe
    from megatron_dapo.run_config import config_from_dict

    data = without_recipe(dapo_config(task, task / "warm", run_dir, seed))  # the arms set the recipe
    data["parallel"] = {**data["parallel"], "seed": seed}
    data["train"] = {**data["train"], "checkpoint_every": 0, "tensorboard": False}
    data["eval"] = {**data["eval"], "every": 0}
    if quick:
        data["eval"]["max_prompts"] = 32
    return config_from_dict(data, arm_overrides(index))


def run_arm(task: Path, run_dir: Path, index: int, seed: int, budget: int, quick: bool) -> dict:
    """Train arm `index` until `budget` samples are generated, then evaluate (in a child process of its own, or
    in this one with --quick)."""
    from megatron_dapo.parallel.runtime import free_port
    from megatron_dapo.trainer import DapoTrainer

    cfg = run_config(task, run_dir, index, seed, quick)
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
            curve.append({"samples": generated, "accuracy": m["accuracy"], "entropy": m.get("entropy", math.nan),
                          "response_len": m["response_len_mean"], "truncation": m["truncation_rate"],
                          "trained": int(m["groups_kept"]) * cfg.algorithm.group_size})
        train_s = time.perf_counter() - start
        after = trainer.evaluate()
    finally:
        trainer.close()
    k = cfg.eval.samples_per_prompt
    return {"curve": curve, "train_s": train_s, "k": k, "avg": after[f"eval/avg@{k}"], "pass": after[f"eval/pass@{k}"],
            "before": {key.split("/")[1]: v for key, v in before.items()}}


def prepare(out: Path) -> Path:
    """The demo's task and warm model, made once in `out`."""
    from megatron_dapo.demo import WARM_START, prepare_task
    from megatron_dapo.demo.warm_start import supervised_warm_start

    if not (out / "warm" / "config.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        supervised_warm_start(out / "base", out / "warm", prepare_task(out, seed=0), seed=0, **WARM_START)
    return out


def check_last_arm_is_dapo(task: Path, out: Path) -> None:
    """The arms' end is preset dapo, switch for switch."""
    from megatron_dapo.algorithm.presets import PRESETS
    from megatron_dapo.demo import dapo_config, without_recipe
    from megatron_dapo.run_config import config_from_dict

    last = run_config(task, out / "check", len(ARMS) - 1, 0, quick=False)
    data = without_recipe(dapo_config(task, task / "warm", out / "check", 0))
    data["algorithm"]["preset"] = "dapo"
    dapo = config_from_dict(data, ["algorithm.oversample_factor=1.5", "algorithm.overlong_cache_len=4"])
    for key in PRESETS["dapo"]:
        section, name = key.split(".")
        mine, theirs = getattr(getattr(last, section), name), getattr(getattr(dapo, section), name)
        if mine != theirs:
            raise SystemExit(f"the last arm is not DAPO: {key} is {mine!r}, preset dapo's {theirs!r}")


def run_child(task: Path, out: Path, index: int, seed: int, budget: int, quick: bool) -> dict:
    run_dir = out / f"arm{index}_seed{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, __file__, "--task", str(task), "--out", str(out), "--arm", str(index), "--seed", str(seed),
           "--budget", str(budget)] + (["--quick"] if quick else [])
    with open(run_dir / "log.txt", "w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "2"})
    if done.returncode:
        raise SystemExit(f"arm {ARMS[index][0]!r} seed {seed} failed ({done.returncode}):\n"
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


def print_table(results: dict[int, list[dict]], before: dict, budget: int) -> None:
    k = next(iter(results.values()))[0]["k"]
    print(f"\nwarm model: held-out avg@{k} {100 * before[f'avg@{k}']:.1f} %, pass@{k} {100 * before[f'pass@{k}']:.1f} %; "
          f"{budget} samples generated per run; mean ± sd over {len(next(iter(results.values())))} seed(s)")
    print(f"| arm | avg@{k} % | pass@{k} % | train acc. % (last 25%) | entropy first 25% -> last 25% | "
          "response len (last 25%) | truncated % (last 25%) | samples / kept sample | steps | train s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for index, runs in results.items():
        curves = [r["curve"] for r in runs]
        print(f"| {ARMS[index][0]} | {mean_sd([r['avg'] for r in runs], 100)} | {mean_sd([r['pass'] for r in runs], 100)}"
              f" | {mean_sd([quarter_mean(c, 'accuracy', True) for c in curves], 100)}"
              f" | {mean_sd([quarter_mean(c, 'entropy', False) for c in curves], 1, 3)} -> "
              f"{mean_sd([quarter_mean(c, 'entropy', True) for c in curves], 1, 3)}"
              f" | {mean_sd([quarter_mean(c, 'response_len', True) for c in curves])}"
              f" | {mean_sd([quarter_mean(c, 'truncation', True) for c in curves], 100)}"
              f" | {statistics.fmean(c[-1]['samples'] / max(1, sum(p['trained'] for p in c)) for c in curves):.2f}"
              f" | {mean_sd([len(c) for c in curves])} | {mean_sd([r['train_s'] for r in runs])} |")


def plot(results: dict[int, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for index, runs in results.items():
        end = min(r["curve"][-1]["samples"] for r in runs)
        grid = np.linspace(min(r["curve"][0]["samples"] for r in runs), end, 50)
        for ax, key in zip(axes, ("accuracy", "entropy")):
            ys = [np.interp(grid, [p["samples"] for p in r["curve"]], [p[key] for p in r["curve"]]) for r in runs]
            ax.plot(grid, np.mean(ys, axis=0), label=ARMS[index][0])
    for ax, title in zip(axes, ("training accuracy", "policy entropy (nats / token)")):
        ax.set_xlabel("samples generated")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=40, help="the budget in steps of the demo's batch (32 x 8)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/ablation"))
    parser.add_argument("--task", type=Path, help="a folder with the demo's train.jsonl, eval.jsonl and warm/ "
                        "(default: made in --out)")
    parser.add_argument("--quick", action="store_true", help="1 seed, 2 steps' samples, 32 held-out problems")
    parser.add_argument("--arm", type=int, help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm is not None:
        result = run_arm(args.task, args.out / f"arm{args.arm}_seed{args.seed}" / "run", args.arm, args.seed,
                         args.budget, args.quick)
        (args.out / f"arm{args.arm}_seed{args.seed}" / "result.json").write_text(json.dumps(result))
        return 0

    from megatron_dapo.demo import DAPO

    seeds, steps = ([args.seeds[0]], 2) if args.quick else (args.seeds, args.steps)
    args.out.mkdir(parents=True, exist_ok=True)
    task = args.task or prepare(args.out)
    check_last_arm_is_dapo(task, args.out)
    budget = steps * DAPO["algorithm"]["batch_size"] * DAPO["algorithm"]["group_size"]
    results: dict[int, list[dict]] = {i: [] for i in range(len(ARMS))}
    before = {}
    start = time.perf_counter()
    for seed in seeds:  # seed-major: a cut-short run still has every arm of its first seeds
        for index in range(len(ARMS)):
            # The full run gives each arm a process of its own (no heap or allocator state carried into the next
            # one's timing); the quick one runs them here, one after another, at half the start-up cost.
            r = (run_arm(task, args.out / f"arm{index}_seed{seed}" / "run", index, seed, budget, quick=True)
                 if args.quick else run_child(task, args.out, index, seed, budget, quick=False))
            results[index].append(r)
            before = before or r["before"]
            print(f"seed {seed} {ARMS[index][0]}: avg@{r['k']} {100 * r['avg']:.1f} %, {len(r['curve'])} steps, "
                  f"{r['train_s']:.0f} s", flush=True)
    print_table(results, before, budget)
    plot(results, args.out / "ablation.png")
    print(f"\nfigure: {args.out / 'ablation.png'}; total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
