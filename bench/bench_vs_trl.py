"""Our DAPO phase side by side with TRL's GRPOTrainer, on the demo's task and warm-started model, on this machine.

Both sides start from one warm model (the demo's task, tiny Qwen2 and supervised warm start, built once) and train
40 rollout steps of 32 prompts x 8 responses with 2 optimizer updates each, lr 2e-4 (warmup 5 rollout steps,
then constant), AdamW without weight decay, gradient clip 1.0, eps 0.2 / 0.28, no KL term, token-level loss,
the soft overlong punishment (12 tokens, 4 of cache) and our math-verify judge (+1 / -1) as the reward. Ours is the
demo's DAPO config (`megatron_dapo.demo.dapo_config`: the Megatron policy, the local engine, dynamic sampling)
without its in-loop evaluation; TRL's is GRPOConfig(loss_type="dapo") set as close as TRL allows (it has no
dynamic sampling: a batch keeps its all-right and all-wrong groups, which carry no gradient).

Each side runs in its own process; "train s" is its training call alone (no model load, no export; the judge is
loaded before it on both sides, and ours includes writing its final checkpoint, model and optimizer). One evaluator
judges the warm model and every trained one: Hugging Face `generate`, avg@4 on the 256 held-out prompts at
temperature 1, the same seed for every model. Rounds alternate which side goes first. The machine's CPU steal
time during each run (from /proc/stat) and the cores the run's processes used are printed with it: these
machines are shared, and the table says how noisy it was.

    pip install -e .[bench]   # TRL, for this benchmark only
    python bench/bench_vs_trl.py [--seeds 0 1] [--steps 40] [--out /tmp/bench_vs_trl]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

NUM_EVAL_SAMPLES = 4
EVAL_SEED = 1234


def cpu_jiffies() -> tuple[int, int]:
    """(steal, total) jiffies of the whole machine since boot, from /proc/stat's `cpu` line."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice: already counted in user and nice]
    return fields[7], sum(fields[:8])


def tree_cpu_seconds() -> float:
    """CPU seconds used so far by this process and its live children (our reward workers)."""
    import psutil

    me = psutil.Process()
    procs = [me, *me.children(recursive=True)]
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def timed(train) -> dict:
    wall, cpu = time.perf_counter(), tree_cpu_seconds()
    train()
    wall, cpu = time.perf_counter() - wall, tree_cpu_seconds() - cpu
    return {"train_s": wall, "cores": cpu / wall}


# -- the two sides, each in its own process ------------------------------------------------------------------


def run_ours(out: Path, seed: int, steps: int, final: Path) -> dict:
    import yaml

    from megatron_dapo.checkpoint.hf_export import export_hf_checkpoint
    from megatron_dapo.demo import dapo_config
    from megatron_dapo.parallel.runtime import free_port
    from megatron_dapo.run_config import load_config
    from megatron_dapo.trainer import DapoTrainer

    data = dapo_config(out, out / "warm", final.parent / "run", seed)
    data["train"] = {**data["train"], "steps": steps}
    data["eval"] = {**data["eval"], "every": 0}  # TRL evaluates nothing while it trains
    path = final.parent / "dapo.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    cfg = load_config(path)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    trainer = DapoTrainer(cfg)
    try:
        result = timed(trainer.train)
        policy = trainer.policy
        export_hf_checkpoint(policy.module, policy.spec, cfg.parallel, final, hf_config=policy.hf_config,
                             side_files_from=cfg.model.path)
    finally:
        trainer.close()
    return result


def run_trl(out: Path, seed: int, steps: int, final: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.rewards import get_soft_overlong_punishment

    from megatron_dapo.data.prompt_file import load_prompt_rows
    from megatron_dapo.demo import DAPO

    algo, optim = DAPO["algorithm"], DAPO["optim"]
    updates = DAPO["train"]["updates_per_step"]
    rows, _ = load_prompt_rows(out / "train.jsonl")
    dataset = Dataset.from_list([{"prompt": r.prompt, "ground_truth": r.ground_truth} for r in rows])
    group = algo["group_size"]
    config = GRPOConfig(
        output_dir=str(final.parent / "run"), seed=seed, use_cpu=True, bf16=False, report_to="none",
        save_strategy="no", logging_steps=10, disable_dropout=True,
        # One generation of batch_size x group_size completions feeds `updates` optimizer steps, used once each.
        num_generations=group, per_device_train_batch_size=algo["batch_size"] * group // updates,
        gradient_accumulation_steps=1, steps_per_generation=updates, num_iterations=1, max_steps=steps * updates,
        max_completion_length=algo["max_response_len"], temperature=DAPO["rollout"]["temperature"], top_p=1.0,
        loss_type="dapo", epsilon=DAPO["loss"]["eps_low"], epsilon_high=DAPO["loss"]["eps_high"], beta=0.0,
        scale_rewards="group", learning_rate=optim["lr"], lr_scheduler_type="constant_with_warmup",
        warmup_steps=optim["warmup_steps"] * updates, weight_decay=optim["weight_decay"],
        max_grad_norm=optim["clip_grad"], optim="adamw_torch")
    model = AutoModelForCausalLM.from_pretrained(out / "warm", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(out / "warm")
    overlong = get_soft_overlong_punishment(algo["max_response_len"], algo["overlong_cache_len"])
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, args=config, train_dataset=dataset,
                          reward_funcs=[judge_reward, overlong])
    is_correct("Answer: 2", "2")  # math-verify imported before the clock starts, as our reward workers start in setup
    result = timed(trainer.train)
    trainer.save_model(str(final))
    tokenizer.save_pretrained(final)
    return result


def judge_reward(completions, ground_truth, **_) -> list[float]:
    """Our judge as a TRL reward function: +1 if the final answer is right, else -1."""
    return [1.0 if is_correct(c[0]["content"] if isinstance(c, list) else c, g) else -1.0
            for c, g in zip(completions, ground_truth)]


def is_correct(text: str, ground_truth: str) -> bool:
    from megatron_dapo.reward.final_answer import final_answer
    from megatron_dapo.reward.math_verifier import judge_answer

    answer = final_answer(text)
    return answer is not None and judge_answer(answer, ground_truth).correct


# -- the one evaluator ---------------------------------------------------------------------------------------


def evaluate(model_dir: Path, out: Path) -> float:
    """avg@4 on the held-out prompts: transformers generate at temperature 1, the same seed for every model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_dapo.data.prompt_encoding import encode_prompt
    from megatron_dapo.data.prompt_file import load_prompt_rows
    from megatron_dapo.demo import DAPO

    tokenizer = AutoTokenizer.from_pretrained(out / "warm")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows, _ = load_prompt_rows(out / "eval.jsonl")
    prompts = [encode_prompt(tokenizer, r.prompt) for r in rows]
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left-padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(EVAL_SEED)
    with torch.no_grad():
        generated = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                                   top_k=0, max_new_tokens=DAPO["algorithm"]["max_response_len"],
                                   num_return_sequences=NUM_EVAL_SAMPLES, pad_token_id=pad)
    texts = tokenizer.batch_decode(generated[:, width:], skip_special_tokens=True)
    truths = [r.ground_truth for r in rows for _ in range(NUM_EVAL_SAMPLES)]
    return sum(map(is_correct, texts, truths)) / len(texts)


# -- the driver ----------------------------------------------------------------------------------------------


def prepare(out: Path) -> None:
    """The demo's task and warm model, once."""
    from megatron_dapo.demo import warm_task

    if (out / "warm" / "config.json").exists():
        return
    warm_task(out, seed=0)


def run_side(side: str, out: Path, seed: int, steps: int) -> dict:
    """One side's run in a child process: its training seconds, the machine's steal share meanwhile."""
    final = out / f"{side}_seed{seed}" / "final"
    final.parent.mkdir(parents=True, exist_ok=True)
    steal0, total0 = cpu_jiffies()
    subprocess.run([sys.executable, __file__, "--side", side, "--seed", str(seed), "--steps", str(steps),
                    "--out", str(out)], check=True, stdout=open(final.parent / "log.txt", "w"),
                   stderr=subprocess.STDOUT)
    steal1, total1 = cpu_jiffies()
    result = json.loads((final.parent / "result.json").read_text())
    result["steal"] = (steal1 - steal0) / max(1, total1 - total0)
    result["accuracy"] = evaluate(final, out)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_vs_trl"))
    parser.add_argument("--side", choices=["ours", "trl"], help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        final = args.out / f"{args.side}_seed{args.seed}" / "final"
        result = (run_ours if args.side == "ours" else run_trl)(args.out, args.seed, args.steps, final)
        (final.parent / "result.json").write_text(json.dumps(result))
        return 0

    args.out.mkdir(parents=True, exist_ok=True)
    prepare(args.out)
    before = evaluate(args.out / "warm", args.out)
    print(f"warm model: avg@{NUM_EVAL_SAMPLES} {100 * before:.1f} % on the held-out prompts", flush=True)
    rows, ratios = [], []
    for i, seed in enumerate(args.seeds):
        order = ("ours", "trl") if i % 2 == 0 else ("trl", "ours")
        results = {}
        for side in order:
            results[side] = r = run_side(side, args.out, seed, args.steps)
            r["gain"] = 100 * (r["accuracy"] - before)
            r["per_min"] = r["gain"] / (r["train_s"] / 60)
            rows.append((seed, side, order[0] == side, r))
            print(f"seed {seed} {side}: {r['train_s']:.1f} s, avg@{NUM_EVAL_SAMPLES} {100 * r['accuracy']:.1f} %, "
                  f"steal {100 * r['steal']:.1f} %", flush=True)
        ratios.append(results["ours"]["per_min"] / results["trl"]["per_min"])

    print(f"\n{args.steps} rollout steps each; warm model avg@{NUM_EVAL_SAMPLES} {100 * before:.1f} %")
    print("| seed | side | first | train s | cores used | steal % | avg@4 after | gain, points | points / train min |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for seed, side, first, r in rows:
        print(f"| {seed} | {side} | {'yes' if first else 'no'} | {r['train_s']:.1f} | {r['cores']:.2f} | "
              f"{100 * r['steal']:.1f} | {100 * r['accuracy']:.1f} | {r['gain']:+.1f} | {r['per_min']:.1f} |")
    print(f"\nours / TRL, points per training minute, by round: {', '.join(f'{x:.2f}' for x in ratios)}; "
          f"median {statistics.median(ratios):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
