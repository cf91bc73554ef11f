"""A short DAPO run on one device, end to end: it must learn, resume, and export what it computes. With
--preset grpo the same run is GRPO's (algorithm.preset grpo: symmetric clip, the sample-level loss, every group
trained on, a k3 KL term against the initial policy), the baseline, held to the same checks.

1. The demo's task and warm model (`megatron-dapo demo`'s: two-digit sums, a tiny Qwen2 and its tokenizer,
   warm-started in plain transformers on the CPU), made in OUT/task or taken from --task.
2. `DapoTrainer` in this process (one rank, the in-process engine, the demo's DAPO settings,
   parallel.device = --device, model.dtype = --dtype) for --steps steps. It must learn: after the first update
   the weights are still close to the loaded ones (a bf16 optimizer whose fp32 master copy held anything else
   puts that back), no later step samples only groups of one verdict (a collapsed policy's steps do), and
   held-out accuracy (avg@4 over 256 prompts) rises by at least MIN_GAIN.
3. The run's checkpoint resumed by a new trainer: the same weights, bitwise, and a step that trains.
4. The trained weights exported to a Hugging Face folder, loaded with transformers, and its log-probs
   of a few sequences compared with the policy's: within 1e-4 in fp32, 0.1 in bf16 (the policy runs in bf16,
   transformers in fp32 on the same bf16 weights).

Prints a result table, writes OUT/e2e_dapo.json, exits 1 if a check failed. On the CPU run it with
MEGATRON_DAPO_DEVICE_FAITHFUL=1 (the tests do) to catch what would mix host and device tensors on a GPU, and
--dtype bfloat16 to train at the GPU's precision.

    python tests/gpu/e2e_dapo.py [--device cuda|cpu] [--dtype bfloat16|float32] [--out DIR] [--task DIR]
                                 [--steps N] [--preset dapo|grpo]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# torch is imported where it is used: the reward workers, which multiprocessing spawns, import this file again and
# need none of it (2 s of CPU each).

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TOLERANCE = {"float32": 1e-4, "bfloat16": 0.1}  # max |log-prob difference|, policy vs transformers
FIRST_UPDATE_MAX_CHANGE = 0.05  # of the largest loaded weight; a master copy of the initialisation moves ~0.2-1
MIN_GAIN = 0.1  # held-out avg@4 over 256 prompts x 4 samples (+-0.015): measured +0.23 in 10 bf16 steps on the CPU
PARITY_SEQUENCES = 8


def dapo_config(task: Path, out: Path, device: str, dtype: str, steps: int, seed: int, preset: str) -> dict:
    """The demo's settings for `steps` steps, a checkpoint at the end, no evaluation inside the run; `preset`:
    algorithm.preset (the demo's settings are DAPO's)."""
    from megatron_dapo.demo import dapo_config as demo_config
    from megatron_dapo.demo import without_recipe

    cfg = demo_config(task, task / "warm", out / "dapo", seed)
    if preset != "dapo":  # the preset's values, not the demo's DAPO recipe
        cfg = without_recipe(cfg)
        cfg["algorithm"]["preset"] = preset
    return {**cfg, "model": {**cfg["model"], "dtype": dtype}, "parallel": {**cfg["parallel"], "device": device},
            "train": {**cfg["train"], "steps": steps, "checkpoint_every": steps, "tensorboard": False},
            "eval": {**cfg["eval"], "every": 0}}


def make_task(task: Path, seed: int) -> dict:
    """The demo's task and warm model in `task`; the warm start's figures."""
    from megatron_dapo.demo import warm_task

    steps, accuracy = warm_task(task, seed)
    return {"steps": steps, "accuracy": accuracy}


def parity_sequences(task: Path):
    """A few training prompts with their solutions, as the policy's and transformers' log-probs take them."""
    import torch
    from transformers import AutoTokenizer

    from megatron_dapo.data.prompt_encoding import encode_prompt
    from megatron_dapo.data.prompt_file import load_prompt_rows
    from megatron_dapo.policy.batch import Sequence

    tok = AutoTokenizer.from_pretrained(task / "warm")
    rows, _ = load_prompt_rows(str(task / "train.jsonl"))
    seqs = []
    for r in rows[:PARITY_SEQUENCES]:
        prompt = encode_prompt(tok, r.prompt)
        seqs.append(Sequence(torch.tensor(prompt + tok.encode(r.extra_info["solution"]) + [tok.eos_token_id]),
                             len(prompt)))
    return seqs


def transformers_logprobs(model_dir: Path, seqs, device: str) -> list[torch.Tensor]:
    """Response-token log-probs (fp64, on the host) from the exported folder, computed in fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            logits = model(s.tokens[None].to(device)).logits[0].double()
            logp = torch.log_softmax(logits, dim=-1)[s.prompt_len - 1:-1]
            out.append(logp.gather(1, s.tokens[s.prompt_len:, None].to(device)).squeeze(1).cpu())
    return out


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def weights(trainer) -> list[torch.Tensor]:
    """The policy's parameters, copied to the host."""
    return [p.detach().cpu().clone() for p in trainer.policy.module.parameters()]


def relative_change(before: list[torch.Tensor], after: list[torch.Tensor]) -> float:
    """The largest change of a weight, over the largest weight."""
    return (max((a.float() - b.float()).abs().max().item() for a, b in zip(after, before))
            / max(b.float().abs().max().item() for b in before))


def mixed_groups(m: dict) -> float:
    """A step's groups of mixed correctness (those with a learning signal), kept or not."""
    return m.get("groups_settled", 0) - m.get("groups_all_correct", 0) - m.get("groups_all_wrong", 0)


def run(device: str, dtype: str, out: Path, task: Path | None, steps: int, seed: int, preset: str) -> dict:
    import dataclasses

    import torch

    from megatron_dapo.checkpoint.hf_export import export_hf_checkpoint
    from megatron_dapo.parallel.runtime import free_port
    from megatron_dapo.policy.forward import response_logprobs
    from megatron_dapo.run_config import config_from_dict
    from megatron_dapo.trainer import DapoTrainer

    times: dict[str, float] = {}
    shutil.rmtree(out / "dapo", ignore_errors=True)  # a fresh run each time, as the demo does
    warm = None
    if task is None:
        task = out / "task"
        task.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        warm = make_task(task, seed)
        times["demo task + warm start (cpu)"] = time.perf_counter() - t

    cfg = config_from_dict(dapo_config(task, out, device, dtype, steps, seed, preset))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # one process: its own rendezvous, as the demo does
    os.environ["MASTER_PORT"] = str(free_port())
    t = time.perf_counter()
    trainer = DapoTrainer(cfg)
    times["trainer init"] = time.perf_counter() - t
    step_metrics = []
    seqs = parity_sequences(task)
    hf_dir = out / "hf"
    try:
        t = time.perf_counter()
        before = trainer.evaluate()["eval/avg@4"]
        loaded = weights(trainer)
        step_metrics.append(trainer.step())
        first_update_change = relative_change(loaded, weights(trainer))
        for _ in range(steps - 1):
            step_metrics.append(trainer.step())
        after = trainer.evaluate()["eval/avg@4"]
        times["dapo steps + 2 evaluations"] = time.perf_counter() - t
        for m in step_metrics:
            for phase in ("rollout", "old_logprob", "train", "sync"):
                key = f"  of which {phase}"
                times[key] = times.get(key, 0.0) + m.get(f"time/{phase}", 0.0)
        t = time.perf_counter()
        trainer.save_checkpoint()
        times["checkpoint save"] = time.perf_counter() - t
        final = weights(trainer)
        t = time.perf_counter()
        policy = trainer.policy
        export_hf_checkpoint(policy.module, policy.spec, cfg.parallel, hf_dir, hf_config=policy.hf_config,
                             side_files_from=cfg.model.path)
        times["export to Hugging Face"] = time.perf_counter() - t
        t = time.perf_counter()
        ours = response_logprobs(trainer.policy.module.eval(), seqs, vocab_size=trainer.policy.spec.vocab_size,
                                 max_positions=trainer.policy.spec.max_position_embeddings,
                                 max_tokens_per_micro_batch=cfg.model.max_tokens_per_micro_batch,
                                 device=trainer.runtime.device)
        ours = [lp.double().cpu() for lp, _ in ours]
        times["policy log-probs"] = time.perf_counter() - t
        trained_dtype = str(trainer.policy.module.config.params_dtype).replace("torch.", "")
    finally:
        trainer.close()
    t = time.perf_counter()
    theirs = transformers_logprobs(hf_dir, seqs, device)
    times["transformers log-probs"] = time.perf_counter() - t
    max_diff = max((a - b).abs().max().item() for a, b in zip(ours, theirs))

    # The checkpoint, resumed by a new trainer for one more step.
    resumed_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps + 1, resume=True))
    os.environ["MASTER_PORT"] = str(free_port())
    t = time.perf_counter()
    trainer = DapoTrainer(resumed_cfg)
    try:
        resumed = {"step": trainer.step_index,
                   "same_weights": all(torch.equal(a, b) for a, b in zip(final, weights(trainer)))}
        m = trainer.step()
        resumed.update(updates=m.get("updates", 0), loss=m.get("loss"), grad_norm=m.get("grad_norm"))
    finally:
        trainer.close()
    times["resume + 1 step"] = time.perf_counter() - t
    return {"device": device, "dtype": trained_dtype, "preset": preset, "warm_start": warm,
            "updates_per_step": cfg.train.updates_per_step,
            "steps": [{k: v for k, v in m.items() if not k.startswith("time/")} | {
                "seconds": m.get("time/step", math.nan)} for m in step_metrics],
            "first_update_change": first_update_change, "eval_before": before, "eval_after": after,
            "resumed": resumed, "parity_tokens": sum(x.numel() for x in ours), "max_logprob_diff": max_diff,
            "tolerance": TOLERANCE[trained_dtype], "seconds": times}


def check(result: dict) -> list[str]:
    problems = []
    for i, m in enumerate(result["steps"], 1):
        if not m.get("updates"):
            if i == 1:  # later steps without one are a collapse, said below
                problems.append(f"step 1: no update (no group to train on, accuracy "
                                f"{m.get('accuracy', math.nan):.2f}): the warm start left nothing to learn from")
            continue
        if m["updates"] != result["updates_per_step"]:
            problems.append(f"step {i}: {m['updates']:.0f} updates, not train.updates_per_step = "
                            f"{result['updates_per_step']}")
        if not (finite(m.get("loss")) and finite(m.get("grad_norm")) and m["grad_norm"] > 0):
            problems.append(f"step {i}: loss {m.get('loss')}, grad norm {m.get('grad_norm')}: not finite and positive")
    if not result["first_update_change"] <= FIRST_UPDATE_MAX_CHANGE:
        problems.append(f"the first update moved the weights by {result['first_update_change']:.3g} of the largest "
                        f"(> {FIRST_UPDATE_MAX_CHANGE}): the optimizer did not update the loaded weights")
    steps = result["steps"]
    empty = [i for i, m in enumerate(steps[1:], 2) if not mixed_groups(m)]
    if empty:
        problems.append(f"steps {empty} sampled no group of mixed correctness: the policy collapsed")
    gain = result["eval_after"] - result["eval_before"]
    if not gain >= MIN_GAIN:
        problems.append(f"no learning: held-out avg@4 {result['eval_before']:.3f} -> {result['eval_after']:.3f} "
                        f"({gain:+.3f}, less than +{MIN_GAIN}) in {len(steps)} steps")
    r = result["resumed"]
    if not (r["step"] == len(steps) and r["same_weights"] and r["updates"] and finite(r["loss"])
            and finite(r["grad_norm"])):
        problems.append(f"resuming the last checkpoint: {r} (expected step {len(steps)}, the same weights bitwise, "
                        "and a step that trains)")
    if not result["max_logprob_diff"] <= result["tolerance"]:
        problems.append(f"exported weights: transformers' log-probs differ from the policy's by "
                        f"{result['max_logprob_diff']:.3g} > {result['tolerance']:g}")
    return problems


def report(result: dict, problems: list[str]) -> None:
    print(f"\n== e2e {result['preset'].upper()} on {result['device']} ({result['dtype']}), one process, in-process "
          "engine ==")
    if result["warm_start"]:
        print(f"warm start: {result['warm_start']['steps']} steps, sampled accuracy "
              f"{100 * result['warm_start']['accuracy']:.0f} %")
    cols = ("groups_kept", "accuracy", "loss", "grad_norm", "updates", "entropy", "mismatch/abs_max", "seconds")
    print(f"{'step':>4} " + " ".join(f"{c:>16}" for c in cols))
    for i, m in enumerate(result["steps"], 1):
        print(f"{i:>4} " + " ".join(f"{m.get(c, math.nan):>16.4g}" for c in cols))
    for name, seconds in result["seconds"].items():
        print(f"  {name:<32}{seconds:8.2f} s")
    print(f"held-out avg@4: {result['eval_before']:.3f} before, {result['eval_after']:.3f} after (at least "
          f"+{MIN_GAIN})")
    print(f"after the first update the weights moved {result['first_update_change']:.2g} of the largest "
          f"(at most {FIRST_UPDATE_MAX_CHANGE}); resumed: {result['resumed']}")
    print(f"max |log-prob policy - transformers (exported)| over {result['parity_tokens']} tokens: "
          f"{result['max_logprob_diff']:.3g} (tolerance {result['tolerance']:g})")
    last = result["steps"][-1] if result["steps"] else {}
    first = result["steps"][0] if result["steps"] else {}
    print(f"figures: steps {len(result['steps'])}, avg@4 {result['eval_before']:.3f} -> {result['eval_after']:.3f}, "
          f"rollout accuracy {first.get('accuracy', math.nan):.2f} -> {last.get('accuracy', math.nan):.2f}, "
          f"first update {result['first_update_change']:.2g}, loss "
          f"{last.get('loss', math.nan):.4g}, grad norm {last.get('grad_norm', math.nan):.3g}, "
          f"max logp diff {result['max_logprob_diff']:.2g}")
    for p in problems:
        print(f"FAILED: {p}")
    print(f"e2e_dapo ({result['preset']}): " + ("FAIL" if problems else "PASS"))


def main(argv=None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, help="working folder (default: a temporary one, removed afterwards)")
    parser.add_argument("--task", type=Path, help="the demo's task and warm model (train.jsonl, eval.jsonl, warm/) "
                                                  "made before; default: made in OUT/task")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                        help="model.dtype (default: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--steps", type=int, default=10, help="training steps (learning is checked)")
    parser.add_argument("--preset", choices=["dapo", "grpo"], default="dapo", help="algorithm.preset")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("megatron_dapo").setLevel(logging.INFO)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("e2e_dapo: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    if args.steps < 2:
        parser.error(f"--steps {args.steps}: at least 2 (the first update is checked apart)")
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    with tempfile.TemporaryDirectory(prefix="e2e_dapo_") as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        result = run(args.device, dtype, out, args.task, args.steps, args.seed, args.preset)
        problems = check(result)
        result["problems"] = problems
        (out / "e2e_dapo.json").write_text(json.dumps(result, indent=1, default=str))
        report(result, problems)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
