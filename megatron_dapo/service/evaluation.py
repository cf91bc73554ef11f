"""Held-out evaluation as the paper reports it: k samples per prompt at the eval section's own sampling settings
(seeded: every evaluation draws alike, so its curve follows the weights), judged by the reward pool."""

from __future__ import annotations

from collections.abc import Callable

from megatron_dapo.config import EvalConfig
from megatron_dapo.reward import Verdict
from megatron_dapo.rollout.engine import Engine, SamplingParams


def eval_params(cfg: EvalConfig, default_max_response_len: int) -> SamplingParams:
    return SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed,
                          max_new_tokens=cfg.max_response_len or default_max_response_len)


def evaluate(engine: Engine, score: Callable[[list[str], list[str]], list[Verdict]], decode: Callable[[list[int]], str],
             prompts: list[list[int]], ground_truths: list[str], params: SamplingParams, k: int) -> dict[str, float]:
    """eval/avg@k (the mean accuracy of one sample) and eval/pass@k (prompts solved by any of their k samples)."""
    if not prompts:
        return {}
    groups = engine.generate(prompts, k, params)
    verdicts = score([decode(s.output_ids) for g in groups for s in g], [t for t in ground_truths for _ in range(k)])
    right = [[v.correct for v in verdicts[i * k:(i + 1) * k]] for i in range(len(prompts))]
    return {f"eval/avg@{k}": sum(map(sum, right)) / (k * len(prompts)),
            f"eval/pass@{k}": sum(map(any, right)) / len(prompts)}
