"""The rollout corrections side by side where off-policy drift can hurt: the demo's task sampled by a real SGLang
server in `async` (rollout.max_staleness responses may be that many weight versions old, and a response may span a
push), at a learning rate that makes stale batches matter, each loss.correction preset beside an arm with no
correction to speak of (token truncate at 1e6: async refuses none), over --seeds seeds.

As in bench_rollout_modes.py, the server is pinned to core 0 and the trainer to core 1, so that sampling and
training overlap as on a disaggregated cluster, and the server is reset to the warm-started model before each run.
The table gives, per arm, held-out avg@4 at the end (mean over seeds, then each seed), the rollout accuracy of the
last 10 steps, and, over all steps, the staleness, the engine-vs-trainer ratios before the correction (token and
sequence maxima, the spread of the sequences' log-ratios) and what the correction did (its mean weight, the shares
of tokens and sequences it masked).

    python bench/bench_off_policy.py [--steps 40] [--seeds 3] [--lr 1.25e-4] [--updates-per-step 8]
                                     [--max-staleness 4] [--server-dtype bfloat16|float32] [--arms sync,none,...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from megatron_dapo.demo import dapo_config, prepare_task
from megatron_dapo.demo.tasks import demo_task
from megatron_dapo.demo.warm_start import supervised_warm_start
from megatron_dapo.ops.loss_settings import CORRECTION_PRESETS
from megatron_dapo.parallel.runtime import free_port
from megatron_dapo.rollout.sglang_server import SGLangServer, SGLangServerConfig, post_json

SERVER_CORE, TRAINER_CORE = 0, 1
# "sync": the on-policy reference (sampled by the weights being trained, no correction): what this learning rate
# gives without staleness. "none": async with a cap no ratio reaches, so every weight is 1 (async needs some
# loss.correction).
ARMS = {"sync": {}, "none": {"level": "token", "action": "truncate", "upper": 1e6},
        **{name: {"preset": name} for name in CORRECTION_PRESETS}}


def run_config(root: Path, out: Path, url: str, arm: str, seed: int, args) -> dict:
    cfg = dapo_config(root, root / "warm", out, seed)
    return {**cfg,
            "parallel": {**cfg["parallel"], "seed": seed},
            "rollout": {**cfg["rollout"], "engine": "sglang", "server_urls": [url], "weight_sync": "disk",
                        **({"mode": "sync"} if arm == "sync" else
                           {"mode": "async", "max_staleness": args.max_staleness})},
            "loss": {**cfg["loss"], "old_logprobs": "recompute", "correction": ARMS[arm]},
            "optim": {**cfg["optim"], "lr": args.lr},
            "train": {**cfg["train"], "steps": args.steps, "updates_per_step": args.updates_per_step,
                      "tensorboard": False},
            "eval": {**cfg["eval"], "every": args.steps}}


def run_arm(root: Path, url: str, arm: str, seed: int, args) -> list[dict]:
    out = root / f"{arm}-{seed}"
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(run_config(root, out, url, arm, seed, args)))
    reset = post_json(f"{url}/update_weights_from_disk", {"model_path": str(root / "warm"), "weight_version": "0"},
                      600)
    assert reset["success"], reset
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGATRON_DAPO_DEVICE_FAITHFUL": "0"}
    cmd = ["taskset", "-c", str(TRAINER_CORE), sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1",
           f"--master_port={free_port()}", "-m", "megatron_dapo.cli", "train", str(path)]
    log = out.with_suffix(".log")
    with open(log, "wb") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        sys.exit(f"{arm}, seed {seed}: training failed ({rc}); {log}:\n{log.read_text()[-4000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summary(runs: list[list[dict]]) -> dict:
    """An arm's numbers over its seeds' runs; None where its runs have no such metric (no correction in sync)."""
    steps = [r for rows in runs for r in rows if "accuracy" in r]

    def over_steps(key, how):
        values = [r[key] for r in steps if key in r]
        return how(values) if values else None

    return {"avg4": [next(r["eval/avg@4"] for r in reversed(rows) if "eval/avg@4" in r) for rows in runs],
            "last_acc": statistics.mean(r["accuracy"] for rows in runs
                                        for r in [s for s in rows if "accuracy" in s][-10:]),
            "staleness": over_steps("staleness/mean", statistics.mean), "stale_max": over_steps("staleness", max),
            "token_max": over_steps("mismatch/token_ratio_max", max),
            "seq_max": over_steps("mismatch/seq_ratio_max", max),
            "seq_std": over_steps("mismatch/seq_log_ratio_std", statistics.mean),
            "kl": over_steps("mismatch/kl", statistics.mean),
            "weight": over_steps("correction/weight_mean", statistics.mean),
            "masked_tok": over_steps("correction/masked_token_frac", statistics.mean),
            "masked_seq": over_steps("correction/masked_seq_frac", statistics.mean)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1.25e-4, help="optim.lr (the demo's 2e-4 with 2 updates)")
    parser.add_argument("--updates-per-step", type=int, default=8,
                        help="optimizer updates per rollout step (the demo's 2; the paper's 16): the longer a step "
                             "trains, the further ahead the servers sample")
    parser.add_argument("--max-staleness", type=int, default=4)
    parser.add_argument("--server-dtype", choices=("float32", "bfloat16"), default="bfloat16",
                        help="the engine's precision (the trainer's is float32): bfloat16 adds an engine mismatch")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"a comma list of {', '.join(ARMS)}")
    parser.add_argument("--workdir", help="keep the runs here (default: a temporary folder)")
    args = parser.parse_args()
    arms = args.arms.split(",")
    if unknown := set(arms) - set(ARMS):
        sys.exit(f"--arms: unknown {sorted(unknown)}; one of {', '.join(ARMS)}")
    if os.cpu_count() < 2:
        sys.exit("needs 2 cores: one for the server, one for the trainer")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.workdir or tmp)
        root.mkdir(parents=True, exist_ok=True)
        if not (root / "warm").is_dir():
            pairs = prepare_task(root, 0)
            supervised_warm_start(root / "base", root / "warm", pairs, seed=0, **demo_task("sums").warm_start)
        config = SGLangServerConfig(str(root / "warm"), device="cpu", dtype=args.server_dtype, max_total_tokens=16384,
                                    startup_timeout_s=900)
        os.sched_setaffinity(0, {SERVER_CORE})  # the server (and its children) inherit core 0
        results, wall = {}, {}
        with SGLangServer(config, root / "server.log") as server:
            os.sched_setaffinity(0, {TRAINER_CORE})
            for arm in arms:
                start = time.perf_counter()
                results[arm] = summary([run_arm(root, server.url, arm, seed, args) for seed in range(args.seeds)])
                wall[arm] = (time.perf_counter() - start) / args.seeds
                print(arm, json.dumps(results[arm]), flush=True)
    print_table(results, wall, args)


def print_table(results: dict[str, dict], wall: dict[str, float], args) -> None:
    print(f"\nthe demo task, {args.steps} steps of {args.updates_per_step} updates, async with max_staleness "
          f"{args.max_staleness}, lr {args.lr:g}, "
          f"engine {args.server_dtype} / trainer float32, seeds 0-{args.seeds - 1}; held-out avg@4 (256 problems, %)")
    print("| arm | avg@4 mean | per seed | vs none, points | rollout acc. last 10 | staleness mean / max | "
          "token ratio max | seq. ratio max | seq. log-ratio std | mean weight | masked tokens % | "
          "masked seqs % | s / run |")
    print("|---|" + "---|" * 12)
    base = statistics.mean(results["none"]["avg4"]) if "none" in results else None
    for arm, r in results.items():
        avg = statistics.mean(r["avg4"])
        versus = f"{100 * (avg - base):+.1f}" if base is not None else "-"
        percent = {k: "-" if r[k] is None else f"{100 * r[k]:.2f}" for k in ("masked_tok", "masked_seq")}
        fmt = {k: "-" if r[k] is None else f"{r[k]:{spec}}" for k, spec in
               (("staleness", ".2f"), ("stale_max", ".0f"), ("token_max", ".3g"), ("seq_max", ".3g"),
                ("seq_std", ".3g"), ("weight", ".4f"))}
        print(f"| {arm} | {100 * avg:.1f} | {' / '.join(f'{100 * a:.1f}' for a in r['avg4'])} | {versus} | "
              f"{100 * r['last_acc']:.1f} | {fmt['staleness']} / {fmt['stale_max']} | {fmt['token_max']} | "
              f"{fmt['seq_max']} | {fmt['seq_std']} | {fmt['weight']} | {percent['masked_tok']} | "
              f"{percent['masked_seq']} | {wall[arm]:.0f} |")


if __name__ == "__main__":
    main()
