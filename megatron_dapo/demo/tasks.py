"""The demo's built-in tasks (`megatron-dapo demo --task`, `bench/ablation.py --task`): what the problems are, how
long a tiny model's context and responses may be, and how far the supervised warm start goes.

- "sums": two-digit sums answered in one line ("47+38=" -> "Answer: 85"), 6 to 7 tokens: the quick demo.
- "chain": sums of 2 to 10 one-digit numbers with every partial sum written out, one line per addition, then the
  answer: 11 to 77 tokens, growing with the problem. The response limit (80 tokens, the soft overlong punishment
  over its last 24) lets the longest correct answers fit only inside the punishment's interval, and a response
  that does not stop is cut off: the task where length, truncation and entropy can move, which is what DAPO's
  components act on.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DemoTask:
    rows: dict  # data.synthetic_math.generate_rows' knobs
    max_positions: int  # the tiny model's context: the longest prompt and response fit
    max_response_len: int  # algorithm.max_response_len (L_max)
    overlong_cache_len: int  # algorithm.overlong_cache_len (L_cache)
    max_tokens_per_micro_batch: int  # a step's responses in one micro-batch when their log-probs are recomputed
    warm_start: dict  # demo.warm_start.supervised_warm_start's knobs


# Both tasks warm-start to about a third right: enough groups with contrast for DAPO to learn from.
WARM_START = dict(target_accuracy=0.3, max_steps=1500, check_every=50, lr=1e-3)

TASKS: dict[str, DemoTask] = {
    "sums": DemoTask(rows=dict(digits=2, operations="+", num_operands=2, style="short"), max_positions=64,
                     max_response_len=12, overlong_cache_len=4, max_tokens_per_micro_batch=8192,
                     warm_start=WARM_START),
    "chain": DemoTask(rows=dict(digits=1, operations="+", num_operands=(2, 10), style="short", steps=True),
                      max_positions=128, max_response_len=80, overlong_cache_len=24, max_tokens_per_micro_batch=32768,
                      warm_start=WARM_START),
}


def demo_task(name: str) -> DemoTask:
    if name not in TASKS:
        raise ValueError(f"--task: one of {', '.join(TASKS)}, got {name!r}")
    return TASKS[name]
