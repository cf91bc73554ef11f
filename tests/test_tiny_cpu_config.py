"""launch/configs/tiny-cpu.yaml, the README's next stop after the demo, keeps the demo's model learning: a few
DAPO steps past its warmup at the file's algorithm and optim settings leave held-out accuracy where it was or
higher, and no step goes without a batch to train on. The file's former settings wrecked the model, and the
run then says once that its steps have nothing to train on."""

import json
import logging
from pathlib import Path

import pytest

from megatron_dapo.algorithm.empty_step_watch import EMPTY_STEPS_TO_WARN
from megatron_dapo.parallel.runtime import free_port
from megatron_dapo.run_config import load_config

pytestmark = pytest.mark.slow
CONFIG = Path(__file__).resolve().parent.parent / "launch" / "configs" / "tiny-cpu.yaml"
STEPS_PAST_WARMUP = 3  # at the full optim.lr: the old lr 1e-3 wrecked the model in its first step
MARGIN = 0.05  # held-out avg@4 may dip this much (noise over 64 prompts x 4 samples); a collapse falls to ~0


def run(demo: Path, out: Path, monkeypatch, *overrides: str, evaluate: bool = True):
    """Train the demo's warm model with tiny-cpu.yaml and these overrides; (the run's config, held-out avg@4
    before and after or None, its metrics records)."""
    from megatron_dapo.trainer import DapoTrainer

    # The in-process engine, not the config's SGLang server: the server's start alone takes minutes on 2 cores,
    # and what this checks (the algorithm and optim settings) does not depend on the engine.
    cfg = load_config(CONFIG, [
        f"model.path={demo / 'warm'}", f"data.train_path={demo / 'train.jsonl'}",
        f"data.eval_path={demo / 'eval.jsonl'}", f"train.output_dir={out}", "rollout.engine=local",
        "train.checkpoint_every=0", "train.resume=false",
        "eval.every=0", "eval.samples_per_prompt=4", "eval.max_prompts=64", "eval.temperature=1.0", "eval.top_p=1.0",
        *overrides])
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    trainer = DapoTrainer(cfg)
    try:
        before = trainer.evaluate()["eval/avg@4"] if evaluate else None
        trainer.train()
        after = trainer.evaluate()["eval/avg@4"] if evaluate else None
    finally:
        trainer.close()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return cfg, before, after, records


def test_the_demo_model_keeps_learning_under_the_tiny_cpu_config(demo, tmp_path, monkeypatch):
    warmup = load_config(CONFIG, [f"model.path={demo / 'warm'}"]).optim.warmup_steps
    cfg, before, after, records = run(demo, tmp_path / "run", monkeypatch, f"train.steps={warmup + STEPS_PAST_WARMUP}")
    print(f"held-out avg@4: {before:.3f} before, {after:.3f} after {cfg.train.steps} steps; rollout accuracy per "
          f"step {[round(r['accuracy'], 3) for r in records]}, groups kept {[r['groups_kept'] for r in records]}")
    assert len(records) == cfg.train.steps
    assert all(r["groups_kept"] > 0 for r in records), "a step had nothing to train on"
    assert after >= before - MARGIN


def test_the_former_settings_collapse_the_model_and_the_run_says_so_once(demo, tmp_path, monkeypatch, caplog):
    former = ("algorithm.batch_size=4", "algorithm.group_size=4", "algorithm.oversample_factor=1.0",
              "algorithm.max_sampling_rounds=3", "algorithm.max_response_len=8", "algorithm.overlong_cache_len=2",
              "optim.lr=1e-3", "optim.warmup_steps=0")
    steps = 1 + EMPTY_STEPS_TO_WARN + 2  # the collapse's step, the stall to be said, and two said no more
    with caplog.at_level(logging.INFO):
        _, _, _, records = run(demo, tmp_path / "run", monkeypatch, f"train.steps={steps}", *former, evaluate=False)
    print(f"former settings: groups kept per step {[r['groups_kept'] for r in records]}")
    # All wrong, but for the odd group, after one update: a quarter of the batch or less after every round.
    assert all(r["groups_kept"] <= 1 and r["round_cap_hit"] for r in records[1:])
    said = [r.getMessage() for r in caplog.records
            if r.name == "megatron_dapo.algorithm.empty_step_watch" and r.levelno == logging.WARNING]
    assert len(said) == 1 and f"steps 2-{1 + EMPTY_STEPS_TO_WARN}:" in said[0] and "optim.lr" in said[0]
    assert not [r for r in caplog.records if "nothing to train on" in r.getMessage() and r.levelno >= logging.WARNING
                and r.name != "megatron_dapo.algorithm.empty_step_watch"]  # the per-step lines are info
