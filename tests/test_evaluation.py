"""Held-out evaluation: its own sampling settings reach the engine; avg@k and pass@k are computed per prompt."""

import pytest

from megatron_dapo.config import ConfigError, EvalConfig
from megatron_dapo.reward import Verdict
from megatron_dapo.samples import Sample
from megatron_dapo.service.evaluation import eval_params, evaluate


class ScriptedEngine:
    """Prompt i's k responses are the token ids in answers[i]; records what it was asked."""

    def __init__(self, answers):
        self.answers, self.calls = answers, []

    def generate(self, prompts, n, params):
        self.calls.append((prompts, n, params))
        return [[Sample(i, [a], [0.0], "stop", "0") for a in self.answers[i][:n]] for i in range(len(prompts))]


def judge(texts, truths):
    return [Verdict(t == g, "ok" if t == g else "wrong") for t, g in zip(texts, truths)]


def test_the_papers_settings_are_the_defaults():
    params = eval_params(EvalConfig(), default_max_response_len=20480)
    assert (params.temperature, params.top_p, params.seed, params.max_new_tokens) == (1.0, 0.7, 0, 20480)
    assert EvalConfig().samples_per_prompt == 32


def test_the_eval_sections_settings_reach_the_engine_and_avg_and_pass_are_per_prompt():
    cfg = EvalConfig(samples_per_prompt=4, temperature=0.6, top_p=0.95, max_response_len=64, seed=7)
    # prompt 0: 1 of 4 right, prompt 1: 4 of 4, prompt 2: none
    engine = ScriptedEngine([[1, 2, 2, 2], [5, 5, 5, 5], [8, 8, 8, 8]])
    result = evaluate(engine, judge, lambda ids: str(ids[0]), [[10], [11], [12]], ["1", "5", "9"],
                      eval_params(cfg, default_max_response_len=999), cfg.samples_per_prompt)
    assert result == {"eval/avg@4": pytest.approx(5 / 12), "eval/pass@4": pytest.approx(2 / 3)}
    [(prompts, n, params)] = engine.calls
    assert (prompts, n) == ([[10], [11], [12]], 4)
    assert (params.temperature, params.top_p, params.max_new_tokens, params.seed) == (0.6, 0.95, 64, 7)


def test_no_prompts_no_metrics():
    engine = ScriptedEngine([])
    assert evaluate(engine, judge, str, [], [], eval_params(EvalConfig(), 8), 4) == {}
    assert engine.calls == []


@pytest.mark.parametrize("kw,key", [(dict(samples_per_prompt=0), "eval.samples_per_prompt"),
                                    (dict(top_p=0.0), "eval.top_p"), (dict(temperature=0.0), "eval.temperature"),
                                    (dict(max_response_len=0), "eval.max_response_len"), (dict(seed=-1), "eval.seed")])
def test_bad_settings_name_the_key(kw, key):
    with pytest.raises(ConfigError, match=key):
        EvalConfig(**kw)
