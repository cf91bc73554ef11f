"""The demo's "chain" task, made for the paper's ablation (issue: long reasoning of varied length): sums of 2 to 10
numbers with every partial sum written out. Its rows are right by math-verify and its held-out problems are not
trained on, its answers' lengths grow with the problem up to the response limit's soft-punishment interval, and the
tiny model learns it with DAPO."""

import statistics

import pytest
from conftest import train_in_process

from megatron_dapo.data.held_out_split import problem_key, split_held_out
from megatron_dapo.data.synthetic_math import generate_rows
from megatron_dapo.demo.tasks import TASKS, demo_task
from megatron_dapo.reward.final_answer import final_answer
from megatron_dapo.reward.math_verifier import judge_answer

CHAIN = TASKS["chain"]


def test_every_reference_answer_is_right_by_math_verify_and_a_slip_in_the_working_is_wrong():
    rows = generate_rows(400, 0, **CHAIN.rows)
    for row in rows:
        truth, solution = row["reward_model"]["ground_truth"], row["extra_info"]["solution"]
        assert judge_answer(final_answer(solution), truth).correct, row
        lines = solution.split("\n")
        # one line per addition, each carrying the running total, and the answer the last total
        assert len(lines) == row["extra_info"]["expression"].count("+") + 1
        assert lines[-2].split("=")[1] == truth
        slipped = str(int(truth) + 1)
        assert not judge_answer(final_answer("\n".join(lines[:-1] + [f"Answer: {slipped}"])), truth).correct


def test_held_out_problems_are_never_trained_on():
    rows = generate_rows(2000, 0, **CHAIN.rows)
    train, held_out = split_held_out(rows, 256, 0)
    assert len(held_out) == 256 and {problem_key(r) for r in train}.isdisjoint({problem_key(r) for r in held_out})


def test_answers_grow_with_the_problem_into_the_soft_punishment_interval():
    """Tokenized as the demo's tiny model reads them (its tokenizer, trained on the task's text as the demo trains
    it): 2 numbers take 11 to 13 tokens (with the end token), 10 up to 77. The longest fit under L_max (80) only
    inside the punishment's interval (its last 24 tokens), so a policy that rambles or repeats a line is cut off,
    and the overlong treatment has lengths to act on."""
    from megatron_dapo.demo.tiny_model import train_tokenizer

    rows = generate_rows(3000, 0, **CHAIN.rows)
    tokenizer = train_tokenizer([r["prompt"][0]["content"] + r["extra_info"]["solution"] for r in rows], 320)
    lengths: dict[int, list[int]] = {}
    for row in rows:
        count = row["extra_info"]["expression"].count("+") + 1
        lengths.setdefault(count, []).append(len(tokenizer.encode(row["extra_info"]["solution"])) + 1)
    assert sorted(lengths) == list(range(2, 11))
    shortest, longest = min(lengths[2]), max(lengths[10])
    assert shortest <= 13 and CHAIN.max_response_len - CHAIN.overlong_cache_len < longest <= CHAIN.max_response_len
    means = [sum(v) / len(v) for _, v in sorted(lengths.items())]
    assert means == sorted(means)


def test_an_unknown_task_is_refused_by_name():
    with pytest.raises(ValueError, match="--task: one of sums, chain, got 'chains'"):
        demo_task("chains")


@pytest.mark.slow
def test_the_tiny_model_learns_the_chain_task(chain, tmp_path, monkeypatch):
    """The demo's DAPO phase on the chain task (its shorter problems: the suite's warm start, see conftest's `chain`)
    for 30 steps: the reward (+1 right, -1 wrong) rises, on the rollouts and on the held-out problems (all 256, 4
    samples each). Measured (the suite's bf16, seeds 0 and 1): rollout accuracy 0.41 over the first 5 steps, 0.52
    over the last 5; held-out avg@4 0.308 -> 0.376 and 0.384. Fewer steps do not show it on every machine: the warm
    model differs with the CPU's arithmetic, and on one the held-out accuracy went 0.308 -> 0.257 to 0.302 in 8 steps
    and rose 0.017 to 0.025 in 20, while the rollouts' step-to-step noise (32 prompts of 2 to 4 numbers) is 0.05. The
    base model, right on nothing, could not pass; a step that unlearns falls instead.
    In fp32: on a CPU without avx512_bf16 (an EPYC with AVX2 only) bf16 matrix products are emulated, and the 30
    steps took 10 minutes there alone and over 15 beside the other lane (the suite's timeout), against 2.5 minutes in
    fp32 (rollout accuracy 0.40 -> 0.52 over the first and last 5 steps, held-out 0.246 -> 0.360; in bf16 on that
    machine 0.257 -> 0.377). What this checks is learning on the task; the GPU's precision is the other learning
    tests' (test_trainer_loop's bf16 run, the tiny CPU config, the MoE)."""
    from megatron_dapo.demo import dapo_config

    cfg = dapo_config(chain, chain / "warm", tmp_path / "run", seed=0, task="chain")
    cfg["train"] = {**cfg["train"], "steps": 30, "tensorboard": False}
    cfg["eval"] = {**cfg["eval"], "every": 0}
    cfg["model"] = {**cfg["model"], "dtype": "float32"}
    before, after, rows = train_in_process(cfg, tmp_path, monkeypatch)
    accuracy = [r["accuracy"] for r in rows]
    print(f"rollout accuracy per step {[round(a, 3) for a in accuracy]}; held-out avg@4 {before:.3f} -> {after:.3f}")
    assert len(rows) == 30 and all(r["groups_kept"] > 0 for r in rows)
    assert statistics.mean(accuracy[-5:]) > statistics.mean(accuracy[:5]) + 0.05
    # 1024 samples each side: a standard error of about 0.02 on the difference
    assert after >= before + 0.02
