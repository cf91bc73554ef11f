"""The start-up log-prob check's verdicts (rollout/logprob_check.py), without servers or torch.distributed; the real
SGLang servers at PP=2 are in test_rollout_sglang.py."""

import pytest

from megatron_dapo.config import ConfigError
from megatron_dapo.rollout.engine import Sample
from megatron_dapo.rollout.logprob_check import check_engine_logprobs, check_prompts, judge

TEMPERED = [[-0.5, -1.2, -0.01], [-2.0, -0.3]]
UNTEMPERED = [[-0.7, -1.5, -0.05], [-2.6, -0.4]]


def shifted(rows, by):
    return [[x + by for x in r] for r in rows]


@pytest.mark.parametrize("engine,verdict", [
    (TEMPERED, None),
    (shifted(TEMPERED, 0.02), None),  # bf16-like noise
    (UNTEMPERED, "servers return temperature-1 log-probs"),
    (shifted(UNTEMPERED, 0.01), "servers return temperature-1 log-probs"),
    (shifted(TEMPERED, 0.5), "match neither"),
])
def test_verdicts(engine, verdict):
    agreement, reason = judge(engine, TEMPERED, UNTEMPERED, 0.7)
    assert agreement.tokens == 5
    if verdict is None:
        assert reason is None
    else:
        assert verdict in reason and reason.startswith("rollout.server_urls: ") and "rollout.temperature" in reason


def test_near_temperature_one_noise_is_not_a_refusal():
    near = shifted(TEMPERED, 0.01)  # the two candidates closer than the noise
    noisy = [[x + (0.02 if i % 2 else -0.02) for i, x in enumerate(r)] for r in TEMPERED]
    assert judge(noisy, TEMPERED, near, 0.98)[1] is None
    assert judge(TEMPERED, TEMPERED, TEMPERED, 1.0)[1] is None
    assert "no tokens" in judge([[]], [[]], [[]], 0.7)[1]


class FakeEngine:
    def __init__(self, logprobs=None, error=None):
        self.logprobs, self.error, self.params = logprobs, error, None

    def generate(self, prompts, n, params):
        self.params = params
        if self.error:
            raise self.error
        return [[Sample(i, [5, 6, 7], self.logprobs(p), "length", "0") for _ in range(n)]
                for i, p in enumerate(prompts)]


def test_one_process_check_samples_at_the_runs_temperature_and_recomputes_at_both():
    calls = []

    def recompute(responses, temperature):
        calls.append(temperature)
        assert all(len(p) == 8 and o == [5, 6, 7] and routes is None for p, o, routes in responses)
        return [[-0.1 * temperature] * 3 for _ in responses]

    engine = FakeEngine(lambda p: [-0.07] * 3)
    agreement = check_engine_logprobs(engine, recompute, temperature=0.7)
    assert calls == [0.7, 1.0] and agreement.tokens == 4 * 4 * 3 and agreement.diff_tempered < 1e-12
    assert (engine.params.temperature, engine.params.top_p, engine.params.seed) == (0.7, 1.0, 0)
    with pytest.raises(ConfigError, match="temperature-1 log-probs"):
        check_engine_logprobs(FakeEngine(lambda p: [-0.1] * 3), recompute, temperature=0.7)
    with pytest.raises(ConfigError, match="rollout.server_urls: sampling for the log-prob check failed: "
                                          "ConnectionError: refused"):
        check_engine_logprobs(FakeEngine(error=ConnectionError("refused")), recompute, temperature=0.7)
    assert all(3 <= t < 253 for p in check_prompts() for t in p)
