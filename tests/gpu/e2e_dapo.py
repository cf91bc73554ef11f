"""A short DAPO run on one device, end to end, then its weights exported and checked with transformers.

1. The demo's task (one-digit sums, DAPO-Math-17K schema) and a tiny random Qwen2 with its tokenizer,
   warm-started in plain transformers just enough that some groups have mixed correctness.
2. `DapoTrainer` in this process (one rank, the in-process engine, parallel.device = --device): each
   step is the rollout, math-verify rewards in the reward pool, dynamic sampling, old log-probs and
   train.updates_per_step optimizer updates of the fused loss.
3. The trained weights exported to a Hugging Face folder, loaded with transformers, and its log-probs
   of a few sequences compared with the policy's: within 1e-4 in fp32 (cpu), 0.1 in bf16 (cuda; the
   policy runs in bf16, transformers in fp32 on the same bf16 weights).

Prints a result table, writes OUT/e2e_dapo.json, exits 1 if a check failed. On the CPU run it with
MEGATRON_DAPO_DEVICE_FAITHFUL=1 (the tests do) to catch what would mix host and device tensors on a GPU.

    python tests/gpu/e2e_dapo.py [--device cuda|cpu] [--out DIR] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TOLERANCE = {"cpu": 1e-4, "cuda": 0.1}  # max |log-prob difference|, policy vs transformers
NUM_ROWS = 1200
TASK = dict(digits=1, operations="+", num_operands=2, style="short")
WARM_START = dict(target_accuracy=0.15, max_steps=600, check_every=25, batch_size=16, lr=3e-3)
PARITY_SEQUENCES = 8


def dapo_config(task: Path, out: Path, device: str, steps: int) -> dict:
    return {
        "model": {"path": str(task / "model"), "max_tokens_per_micro_batch": 1024},
        "data": {"train_path": str(task / "train.jsonl"), "seed": 3, "max_prompt_len": 32},
        "parallel": {"device": device, "seed": 7},
        "rollout": {"engine": "local", "temperature": 1.0},
        "reward": {"num_workers": 1, "timeout_s": 5.0},
        "algorithm": {"batch_size": 4, "group_size": 4, "oversample_factor": 1.0, "max_sampling_rounds": 4,
                      "max_response_len": 8, "overlong_cache_len": 2},
        "optim": {"lr": 1e-3, "warmup_steps": 0, "weight_decay": 0.0},
        "train": {"steps": steps, "updates_per_step": 2, "output_dir": str(out / "dapo"), "checkpoint_every": 0,
                  "keep_last": 1, "tensorboard": False, "resume": False},
        "eval": {"every": 0},
    }


def make_task(task: Path, seed: int):
    """Data files and a warm-started tiny model under `task`; returns (prompt ids, solution ids) pairs."""
    from megatron_dapo.data.held_out_split import split_held_out
    from megatron_dapo.data.prompt_encoding import encode_prompt
    from megatron_dapo.data.prompt_file import write_rows
    from megatron_dapo.data.synthetic_math import generate_rows
    from megatron_dapo.demo.tiny_model import make_tiny_model

    rows = generate_rows(NUM_ROWS, seed, **TASK)
    train, held_out = split_held_out(rows, 20, seed)
    write_rows(task / "train.jsonl", train)
    write_rows(task / "eval.jsonl", held_out)
    corpus = [r["prompt"][0]["content"] + r["extra_info"]["solution"] for r in rows]
    tok = make_tiny_model(task / "base", corpus, seed=seed, hidden=64, layers=2)
    return [(encode_prompt(tok, r["prompt"]), tok.encode(r["extra_info"]["solution"]) + [tok.eos_token_id])
            for r in train]


@torch.no_grad()
def transformers_logprobs(model_dir: Path, seqs, device: str) -> list[torch.Tensor]:
    """Response-token log-probs (fp64, on the host) from the exported folder, computed in fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    out = []
    for s in seqs:
        logits = model(s.tokens[None].to(device)).logits[0].double()
        logp = torch.log_softmax(logits, dim=-1)[s.prompt_len - 1:-1]
        out.append(logp.gather(1, s.tokens[s.prompt_len:, None].to(device)).squeeze(1).cpu())
    return out


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def run(device: str, out: Path, steps: int, seed: int) -> dict:
    from megatron_dapo.checkpoint.hf_export import export_hf_checkpoint
    from megatron_dapo.demo.warm_start import supervised_warm_start
    from megatron_dapo.policy.batch import Sequence
    from megatron_dapo.policy.forward import response_logprobs
    from megatron_dapo.run_config import config_from_dict
    from megatron_dapo.runtime import free_port
    from megatron_dapo.trainer import DapoTrainer

    times: dict[str, float] = {}
    task = out / "task"
    task.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    pairs = make_task(task, seed)
    times["data + tiny model"] = time.perf_counter() - t
    t = time.perf_counter()
    warm_steps, warm_accuracy = supervised_warm_start(task / "base", task / "model", pairs, seed=seed, **WARM_START)
    times["warm start (transformers, cpu)"] = time.perf_counter() - t

    cfg = config_from_dict(dapo_config(task, out, device, steps))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # one process: its own rendezvous, as the demo does
    os.environ["MASTER_PORT"] = str(free_port())
    t = time.perf_counter()
    trainer = DapoTrainer(cfg)
    times["trainer init"] = time.perf_counter() - t
    step_metrics = []
    seqs = [Sequence(torch.tensor(p + r), len(p)) for p, r in pairs[:PARITY_SEQUENCES]]
    hf_dir = out / "hf"
    try:
        for _ in range(steps):
            step_metrics.append(trainer.step())
        for m in step_metrics:
            for phase in ("rollout", "old_logprob", "train", "sync"):
                key = f"dapo {phase}"
                times[key] = times.get(key, 0.0) + m.get(f"time/{phase}", 0.0)
        t = time.perf_counter()
        export_hf_checkpoint(trainer.policy.module, trainer.spec, cfg.parallel, hf_dir, hf_config=trainer.hf_config,
                             side_files_from=cfg.model.path)
        times["export to Hugging Face"] = time.perf_counter() - t
        t = time.perf_counter()
        ours = response_logprobs(trainer.policy.module.eval(), seqs, vocab_size=trainer.spec.vocab_size,
                                 max_positions=trainer.spec.max_position_embeddings,
                                 max_tokens_per_micro_batch=cfg.model.max_tokens_per_micro_batch,
                                 device=trainer.runtime.device)
        ours = [lp.double().cpu() for lp, _ in ours]
        times["policy log-probs"] = time.perf_counter() - t
        dtype = str(trainer.policy.module.config.params_dtype).replace("torch.", "")
    finally:
        trainer.close()
    t = time.perf_counter()
    theirs = transformers_logprobs(hf_dir, seqs, device)
    times["transformers log-probs"] = time.perf_counter() - t
    max_diff = max((a - b).abs().max().item() for a, b in zip(ours, theirs))
    return {"device": device, "dtype": dtype, "warm_start_steps": warm_steps, "warm_start_accuracy": warm_accuracy,
            "steps": [{k: v for k, v in m.items() if not k.startswith("time/")} | {
                "seconds": m.get("time/step", math.nan)} for m in step_metrics],
            "parity_tokens": sum(x.numel() for x in ours), "max_logprob_diff": max_diff,
            "tolerance": TOLERANCE[device], "seconds": times}


def check(result: dict) -> list[str]:
    problems = []
    for i, m in enumerate(result["steps"], 1):
        if not m.get("updates"):
            problems.append(f"step {i}: no update (kept {m.get('groups_kept', 0):.0f} groups of mixed correctness, "
                            f"accuracy {m.get('accuracy', math.nan):.2f}): the warm start left nothing to learn from")
            continue
        if m["updates"] != 2:
            problems.append(f"step {i}: {m['updates']:.0f} updates, not train.updates_per_step = 2")
        if not (finite(m.get("loss")) and finite(m.get("grad_norm")) and m["grad_norm"] > 0):
            problems.append(f"step {i}: loss {m.get('loss')}, grad norm {m.get('grad_norm')}: not finite and positive")
    if not result["max_logprob_diff"] <= result["tolerance"]:
        problems.append(f"exported weights: transformers' log-probs differ from the policy's by "
                        f"{result['max_logprob_diff']:.3g} > {result['tolerance']:g}")
    return problems


def report(result: dict, problems: list[str]) -> None:
    print(f"\n== e2e DAPO on {result['device']} ({result['dtype']}), one process, in-process engine ==")
    print(f"warm start: {result['warm_start_steps']} steps, "
          f"sampled accuracy {100 * result['warm_start_accuracy']:.0f} %")
    cols = ("groups_kept", "accuracy", "loss", "grad_norm", "updates", "entropy", "mismatch/abs_max", "seconds")
    print(f"{'step':>4} " + " ".join(f"{c:>16}" for c in cols))
    for i, m in enumerate(result["steps"], 1):
        print(f"{i:>4} " + " ".join(f"{m.get(c, math.nan):>16.4g}" for c in cols))
    for name, seconds in result["seconds"].items():
        print(f"  {name:<32}{seconds:8.2f} s")
    print(f"max |log-prob policy - transformers (exported)| over {result['parity_tokens']} tokens: "
          f"{result['max_logprob_diff']:.3g} (tolerance {result['tolerance']:g})")
    last = result["steps"][-1] if result["steps"] else {}
    print(f"figures: steps {len(result['steps'])}, loss {last.get('loss', math.nan):.4g}, "
          f"grad norm {last.get('grad_norm', math.nan):.3g}, accuracy {last.get('accuracy', math.nan):.2f}, "
          f"max logp diff {result['max_logprob_diff']:.2g}")
    for p in problems:
        print(f"FAILED: {p}")
    print("e2e_dapo: " + ("FAIL" if problems else "PASS"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, help="working folder (default: a temporary one, removed afterwards)")
    parser.add_argument("--steps", type=int, default=None, help="DAPO steps (default: 2 on cuda, 1 on cpu)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("megatron_dapo").setLevel(logging.INFO)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("e2e_dapo: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    steps = args.steps or (2 if args.device == "cuda" else 1)
    with tempfile.TemporaryDirectory(prefix="e2e_dapo_") as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        result = run(args.device, out, steps, args.seed)
        problems = check(result)
        result["problems"] = problems
        (out / "e2e_dapo.json").write_text(json.dumps(result, indent=1, default=str))
        report(result, problems)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
