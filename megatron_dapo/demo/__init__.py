"""The embedded demo (`megatron-dapo demo`, the README's main command): DAPO teaching a tiny model
arithmetic on a laptop CPU in minutes, through the real pipeline.

1. Data: a built-in synthetic task (demo/tasks.py: "sums", "47+38=" -> "Answer: 85", or "chain", sums of
   up to 10 numbers worked line by line), a training file and a held-out file of different problems, in the
   DAPO-Math-17K schema.
2. A tiny random Qwen2 and a tokenizer trained on the task's text, saved as a Hugging Face folder.
3. A short supervised warm start on reference solutions (allowed by the demo's spec): the policy
   learns the answer format and gets some sums right, so that groups have mixed correctness.
4. DAPO with the Megatron policy (gloo, one CPU process), the local in-process engine, math-verify
   rewards, dynamic sampling and the fused loss; held-out avg@k accuracy before and after.
5. The curves as a PNG, and the before / after accuracy and the time per phase printed.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import yaml

from megatron_dapo.data.held_out_split import split_held_out
from megatron_dapo.data.prompt_encoding import encode_prompt
from megatron_dapo.data.prompt_file import write_rows
from megatron_dapo.data.synthetic_math import generate_rows
from megatron_dapo.demo.tasks import demo_task
from megatron_dapo.demo.tiny_model import make_tiny_model
from megatron_dapo.demo.warm_start import supervised_warm_start

NUM_ROWS, NUM_EVAL = 6000, 256
DAPO = {
    "rollout": {"engine": "local", "temperature": 1.0},
    "reward": {"num_workers": 2, "timeout_s": 5.0, "tail_chars": 200},
    "algorithm": {"batch_size": 32, "group_size": 8, "oversample_factor": 1.5, "max_sampling_rounds": 4},
    # The in-process engine samples with the very weights being trained: its log-probs are pi_old's.
    "loss": {"eps_low": 0.2, "eps_high": 0.28, "old_logprobs": "rollout"},
    # warmup in rollout steps. One data-parallel rank: the distributed optimizer would shard nothing and its
    # buffer copies cost a third of each update here (bench/bench_vs_trl.py).
    "optim": {"lr": 2e-4, "warmup_steps": 5, "weight_decay": 0.0, "clip_grad": 1.0, "distributed_optimizer": False},
    "train": {"steps": 40, "updates_per_step": 2, "checkpoint_every": 0, "keep_last": 1, "resume": False},
    "eval": {"every": 10, "samples_per_prompt": 4, "max_prompts": NUM_EVAL, "temperature": 1.0, "top_p": 1.0},
    "parallel": {"device": "cpu"},
}


def prepare_task(out: Path, seed: int, moe: bool = False, task: str = "sums", rows: dict | None = None):
    """The demo task `task` in `out`: train.jsonl, eval.jsonl, the tiny random model (base/; a Qwen3-MoE with
    `moe`); the warm start's pairs. `rows`: generate_rows' knobs over the task's (a narrower share of it)."""
    spec = demo_task(task)
    rows = generate_rows(NUM_ROWS, seed, **{**spec.rows, **(rows or {})})
    train, held_out = split_held_out(rows, NUM_EVAL, seed)
    write_rows(out / "train.jsonl", train)
    write_rows(out / "eval.jsonl", held_out)
    corpus = [r["prompt"][0]["content"] + r["extra_info"]["solution"] for r in rows]
    tokenizer = make_tiny_model(out / "base", corpus, seed=seed, moe=moe, max_positions=spec.max_positions)
    pairs = [(encode_prompt(tokenizer, r["prompt"]), tokenizer.encode(r["extra_info"]["solution"])
              + [tokenizer.eos_token_id]) for r in train]
    return pairs


def warm_task(out: Path, seed: int, moe: bool = False, task: str = "sums", rows: dict | None = None,
              **warm_start) -> tuple[int, float]:
    """prepare_task, then the supervised warm start of base/ into warm/ (the task's knobs, or `warm_start`'s where
    given): (its steps, its sampled accuracy)."""
    pairs = prepare_task(out, seed, moe, task, rows)
    knobs = {**demo_task(task).warm_start, **warm_start}
    return supervised_warm_start(out / "base", out / "warm", pairs, seed=seed, **knobs)


# The demo's DAPO recipe keys: clip-higher's bounds, and those of the switches GRPO turns off (which algorithm.preset
# grpo refuses beside it). A run under another preset, or an ablation arm, leaves them to what it sets.
RECIPE_KEYS = {"algorithm": ("oversample_factor", "overlong_cache_len"), "loss": ("eps_low", "eps_high")}


def without_recipe(cfg: dict) -> dict:
    """dapo_config's `cfg` without RECIPE_KEYS."""
    return {**cfg, **{section: {k: v for k, v in cfg[section].items() if k not in keys}
                      for section, keys in RECIPE_KEYS.items()}}


def dapo_config(out: Path, model: Path, output_dir: Path, seed: int, moe: bool = False, task: str = "sums") -> dict:
    """The DAPO phase's config (a dict in the YAML's shape) for the task `task` in `out`, starting from `model`;
    with `moe` (a mixture of experts) the trainer's routers replay the engine's routes, without a load-balancing
    loss."""
    spec = demo_task(task)
    return {**DAPO, "model": {"path": str(model), "max_tokens_per_micro_batch": spec.max_tokens_per_micro_batch,
                              **({"moe_aux_loss_coef": 0.0} if moe else {})},
            "rollout": {**DAPO["rollout"], **({"routing_replay": True} if moe else {})},
            "algorithm": {**DAPO["algorithm"], "max_response_len": spec.max_response_len,
                          "overlong_cache_len": spec.overlong_cache_len},
            "data": {"train_path": str(out / "train.jsonl"), "eval_path": str(out / "eval.jsonl"), "seed": seed,
                     "max_prompt_len": 32},
            "train": {**DAPO["train"], "output_dir": str(output_dir)}}


def run_demo(output_dir: str = "runs/demo", seed: int = 0, log_file: Path | None = None, moe: bool = False,
             task: str = "sums") -> int:
    """Run the demo in `output_dir`; `log_file`: where the entry point sends the full log (named in the report);
    `moe`: the policy a tiny Qwen3-MoE (one process, so every expert on it: EP = 1), with routing replay; `task`:
    one of demo/tasks.py's."""
    from megatron_dapo.parallel.runtime import free_port
    from megatron_dapo.run_config import load_config
    from megatron_dapo.trainer import DapoTrainer

    out = Path(output_dir)
    shutil.rmtree(out / "dapo", ignore_errors=True)  # a fresh run each time (the data and models are remade too)
    out.mkdir(parents=True, exist_ok=True)
    times = {}
    start = time.perf_counter()
    pairs = prepare_task(out, seed, moe, task)
    times["data + tiny model"] = time.perf_counter() - start
    t = time.perf_counter()
    steps, accuracy = supervised_warm_start(out / "base", out / "warm", pairs, seed=seed,
                                            **demo_task(task).warm_start)
    times["supervised warm start"] = time.perf_counter() - t
    print(f"warm start: {steps} steps, sampled accuracy on training prompts {100 * accuracy:.1f} %", flush=True)

    # The run's config goes beside it: `megatron-dapo train OUT/dapo.yaml` repeats the DAPO phase alone.
    (out / "dapo.yaml").write_text(yaml.safe_dump(dapo_config(out, out / "warm", out / "dapo", seed, moe, task),
                                                  sort_keys=False))
    cfg = load_config(out / "dapo.yaml")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    trainer = DapoTrainer(cfg)
    try:
        t = time.perf_counter()
        before = trainer.evaluate()
        times["evaluation before"] = time.perf_counter() - t
        t = time.perf_counter()
        last = trainer.train()
        times["DAPO training"] = time.perf_counter() - t
        t = time.perf_counter()
        after = trainer.evaluate()
        times["evaluation after"] = time.perf_counter() - t
    finally:
        trainer.close()
    return _report(out, cfg, before, after, last, times, time.perf_counter() - start, log_file)


def _report(out: Path, cfg, before: dict, after: dict, last: dict, times: dict, wall: float,
            log_file: Path | None = None) -> int:
    from megatron_dapo.observability.metrics_plot import plot_metrics

    png = plot_metrics(out / "dapo" / "metrics.jsonl", out / "dapo_curves.png")
    k, steps = cfg.eval.samples_per_prompt, cfg.train.steps
    avg, pass_ = f"eval/avg@{k}", f"eval/pass@{k}"
    print("\n== megatron-dapo demo ==")
    print(f"held-out problems ({len(_eval_lines(out))}), {k} samples each at temperature {cfg.eval.temperature}, "
          f"top_p {cfg.eval.top_p}:")
    print(f"  {'':<22}{'avg@' + str(k):>8}{'pass@' + str(k):>9}")
    for name, m in (("after the warm start", before), (f"after {steps} DAPO steps", after)):
        print(f"  {name:<22}{100 * m[avg]:7.1f}%{100 * m[pass_]:8.1f}%")
    gain_avg, gain_pass = 100 * (after[avg] - before[avg]), 100 * (after[pass_] - before[pass_])
    print(f"  {'gain, points':<22}{gain_avg:+7.1f} {gain_pass:+8.1f}")
    print("time:")
    for name, seconds in times.items():
        print(f"  {name:<24}{seconds:7.1f} s")
    print(f"  {'total':<24}{wall:7.1f} s")
    breakdown = {k[len("time/"):]: v for k, v in last.items() if k.startswith("time/")}
    print("last DAPO step: " + ", ".join(f"{k} {v:.2f} s" for k, v in breakdown.items()))
    print(f"curves: {png}\nmetrics: {out / 'dapo' / 'metrics.jsonl'}")
    if log_file is not None:
        print(f"full log: {log_file}")
    return 0


def _eval_lines(out: Path) -> list[str]:
    return (out / "eval.jsonl").read_text().splitlines()
