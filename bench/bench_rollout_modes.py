"""rollout.mode side by side: `sync`, `one_step_off` and `async`, with a real SGLang server and the real trainer.

This 2-core machine stands in for a disaggregated cluster: the SGLang server is pinned to core 0 and the
trainer to core 1 (CPU affinity, as `taskset` sets it), so that the two run at the same time only when the
trainer lets them. The rollout service process (HTTP, detokenising, dynamic sampling, its reward workers) runs
beside the server on core 0 (--service-core server, as on a cluster where it runs on the rollout nodes), or
beside the trainer on core 1 (--service-core trainer, where the trainer starts it). The model is sized so that
sampling a batch and training on it take about the same time. Each mode trains --steps steps from the same
warm-started model (the server is reset to it before each run); the table gives the mean over all steps but
the first (which waits for its batch in every mode) and the last (nothing is sampled past the end) of the
seconds per step, the responses trained per second, where the step's time went, the seconds the service had no
batch to sample (its servers idle) and the staleness of the responses trained (steps between the weights that
started them and the trainer's).

With --learning, the learning check instead: the demo's task, model, warm start and DAPO settings (the demo
samples in-process; here from the server) trained 40 steps in each mode, held-out avg@4 / pass@4 every 10.

    python bench/bench_rollout_modes.py [--steps 8] [--batch 32] [--hidden 256] [--layers 4] [--response-len 24]
                                        [--max-staleness 2] [--service-core server|trainer]
    python bench/bench_rollout_modes.py --learning
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import yaml

from megatron_dapo.data.held_out_split import split_held_out
from megatron_dapo.data.prompt_encoding import encode_prompt
from megatron_dapo.data.prompt_file import write_rows
from megatron_dapo.data.synthetic_math import generate_rows
from megatron_dapo.demo.tiny_model import make_tiny_model
from megatron_dapo.demo.warm_start import supervised_warm_start
from megatron_dapo.parallel.runtime import free_port
from megatron_dapo.rollout.sglang_server import SGLangServer, SGLangServerConfig, post_json

SERVER_CORE, TRAINER_CORE = 0, 1
MODES = ("sync", "one_step_off", "async")


def prepare_timing(root: Path, hidden: int, layers: int) -> None:
    rows = generate_rows(3000, 0, digits=2, operations="+", num_operands=2, style="short")
    train, held_out = split_held_out(rows, 64, 0)
    write_rows(root / "train.jsonl", train)
    corpus = [r["prompt"][0]["content"] + r["extra_info"]["solution"] for r in rows]
    tok = make_tiny_model(root / "base", corpus, seed=0, hidden=hidden, layers=layers)
    pairs = [(encode_prompt(tok, r["prompt"]), tok.encode(r["extra_info"]["solution"]) + [tok.eos_token_id])
             for r in train]
    supervised_warm_start(root / "base", root / "model", pairs, target_accuracy=0.3, max_steps=1500, batch_size=32)


def timing_config(root: Path, mode: str, args) -> dict:
    return {
        "model": {"path": str(root / "model"), "max_tokens_per_micro_batch": 4096},
        "data": {"train_path": str(root / "train.jsonl"), "seed": 1, "max_prompt_len": 32},
        "parallel": {"device": "cpu", "seed": 7},
        "reward": {"num_workers": 1, "timeout_s": 5.0},
        "algorithm": {"batch_size": args.batch, "group_size": 8, "oversample_factor": 1.5, "max_sampling_rounds": 4,
                      "max_response_len": args.response_len, "overlong_cache_len": 4},
        "loss": {"correction": {"preset": "tis"}},
        "optim": {"lr": 2e-4, "warmup_steps": 0, "weight_decay": 0.0},
        "train": {"steps": args.steps, "updates_per_step": 2, "checkpoint_every": 0, "keep_last": 1,
                  "tensorboard": False, "resume": False},
        "eval": {"every": 0},
    }


def learning_config(root: Path, mode: str, args) -> dict:
    from megatron_dapo.demo import DAPO

    cfg = {**DAPO, "model": {"path": str(root / "model"), "max_tokens_per_micro_batch": 4096},
           "data": {"train_path": str(root / "train.jsonl"), "eval_path": str(root / "eval.jsonl"), "seed": 0,
                    "max_prompt_len": 32},
           "train": {**DAPO["train"], "tensorboard": False}}
    if mode != "sync":
        cfg["loss"] = {**DAPO["loss"], "correction": {"preset": "tis"}}
    return cfg


def pin_rollout_service(trainer: subprocess.Popen) -> None:
    """Move the rollout service process the trainer spawns, and the reward workers it spawns, to the server's
    core, for as long as the trainer runs."""
    while trainer.poll() is None:
        try:
            spawned = [p for p in psutil.Process(trainer.pid).children(recursive=True)
                       if "spawn_main" in " ".join(p.cmdline())]
            for p in spawned:
                if p.cpu_affinity() != [SERVER_CORE]:
                    p.cpu_affinity([SERVER_CORE])
        except psutil.Error:
            pass  # a process that ended meanwhile
        time.sleep(0.5)


def run_mode(root: Path, url: str, mode: str, cfg: dict, args) -> list[dict]:
    out = root / mode
    rollout = {"engine": "sglang", "server_urls": [url], "weight_sync": "disk", "mode": mode}
    if mode == "async":
        rollout["max_staleness"] = args.max_staleness
    cfg = {**cfg, "rollout": rollout,
           "train": {**cfg["train"], "output_dir": str(out)}}
    path = root / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    reset = post_json(f"{url}/update_weights_from_disk", {"model_path": str(root / "model"), "weight_version": "0"},
                      600)
    assert reset["success"], reset
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGATRON_DAPO_DEVICE_FAITHFUL": "0"}
    cmd = ["taskset", "-c", str(TRAINER_CORE), sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1",
           f"--master_port={free_port()}", "-m", "megatron_dapo.cli", "train", str(path)]
    with open(root / f"{mode}.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        if args.service_core == "server":
            threading.Thread(target=pin_rollout_service, args=(proc,), daemon=True).start()
        rc = proc.wait()
    if rc != 0:
        sys.exit(f"{mode}: training failed ({rc}); log {root / f'{mode}.log'}:\n"
                 f"{(root / f'{mode}.log').read_text()[-4000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32, help="groups per step (8 responses each)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--response-len", type=int, default=24)
    parser.add_argument("--max-staleness", type=int, default=2, help="rollout.max_staleness of the async runs")
    parser.add_argument("--service-core", choices=("server", "trainer"), default="trainer",
                        help="where the rollout service process runs: beside the server, or the trainer")
    parser.add_argument("--learning", action="store_true", help="the learning check instead of the timing")
    parser.add_argument("--workdir", help="keep the runs here (default: a temporary folder)")
    args = parser.parse_args()
    if os.cpu_count() < 2:
        sys.exit("needs 2 cores: one for the server, one for the trainer")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.workdir or tmp)
        root.mkdir(parents=True, exist_ok=True)
        if args.learning:
            from megatron_dapo.demo import prepare_task
            from megatron_dapo.demo.tasks import demo_task

            pairs = prepare_task(root, 0)
            supervised_warm_start(root / "base", root / "model", pairs, seed=0, **demo_task("sums").warm_start)
        else:
            prepare_timing(root, args.hidden, args.layers)
        config = SGLangServerConfig(str(root / "model"), device="cpu", dtype="float32", max_total_tokens=16384,
                                    startup_timeout_s=900)
        os.sched_setaffinity(0, {SERVER_CORE})  # the server (and its children) inherit core 0
        with SGLangServer(config, root / "server.log") as server:
            os.sched_setaffinity(0, {TRAINER_CORE})
            make_config = learning_config if args.learning else timing_config
            results = {mode: run_mode(root, server.url, mode, make_config(root, mode, args), args) for mode in MODES}
    (print_learning if args.learning else print_timing)(results, args)


def print_learning(results: dict[str, list[dict]], args) -> None:
    evals = {mode: [r for r in records if "eval/avg@4" in r] for mode, records in results.items()}
    steps = [r["step"] for r in evals["sync"]]
    print(f"\nthe demo task, 40 steps per mode (async: max_staleness {args.max_staleness}), sampled by an SGLang "
          "server; held-out avg@4 / pass@4 (256 problems)")
    print("| mode | " + " | ".join(f"step {s}" for s in steps) + " | avg@4 vs sync, points | wall s |")
    print("|---|" + "---|" * (len(steps) + 2))
    final = evals["sync"][-1]["eval/avg@4"]
    for mode, records in evals.items():
        cells = " | ".join(f"{100 * r['eval/avg@4']:.1f} / {100 * r['eval/pass@4']:.1f}" for r in records)
        wall = sum(r["time/step"] for r in results[mode])
        print(f"| {mode} | {cells} | {100 * (records[-1]['eval/avg@4'] - final):+.1f} | {wall:.0f} |")


def print_timing(results: dict[str, list[dict]], args) -> None:
    rows = []
    for mode, records in results.items():
        timed = records[1:-1]
        step_s = sum(r["time/step"] for r in timed) / len(timed)
        samples = sum(r["groups_kept"] for r in timed) * 8 / sum(r["time/step"] for r in timed)
        parts = {k: sum(r.get(f"time/{k}", 0.0) for r in timed) / len(timed)
                 for k in ("rollout", "sampling", "old_logprob", "train", "rollout_wait", "sync", "rollout_idle")}
        staleness = (sum(r["staleness/mean"] for r in timed) / len(timed), max(r["staleness"] for r in records))
        rows.append((mode, step_s, samples, parts, staleness))
    base = rows[0][1]
    print(f"\n{args.steps} steps each ({args.steps - 2} timed), {args.batch} x 8 responses of <= {args.response_len} "
          f"tokens, model hidden {args.hidden} x {args.layers} layers; server on core {SERVER_CORE}, trainer on core "
          f"{TRAINER_CORE}, rollout service beside the {args.service_core}; async with max_staleness "
          f"{args.max_staleness}")
    print("| mode | s / step | responses / s | speed-up | trainer wait s | server idle s | sampling s | "
          "old log-prob s | train s | sync s | staleness mean / max |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for mode, step_s, samples, p, (mean, most) in rows:
        wait = p["rollout"] + p["rollout_wait"]
        print(f"| {mode} | {step_s:.2f} | {samples:.1f} | {base / step_s:.2f}x | {wait:.2f} | "
              f"{p['rollout_idle']:.2f} | {p['sampling']:.2f} | {p['old_logprob']:.2f} | {p['train']:.2f} | "
              f"{p['sync']:.2f} | {mean:.2f} / {most:.0f} |")


if __name__ == "__main__":
    main()
