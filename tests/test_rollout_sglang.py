"""Rollouts from a real SGLang server on the CPU: grouped sampling, and log-prob parity with the policy."""

import json
import sys
from pathlib import Path

import pytest
from torchrun_launch import torchrun

sys.path.insert(0, str(Path(__file__).parent / "distributed"))
from tiny_models import save_with_tokenizer  # noqa: E402

from megatron_dapo.rollout.engine import SamplingParams  # noqa: E402
from megatron_dapo.rollout.sglang_engine import SGLangEngine  # noqa: E402
from megatron_dapo.rollout.sglang_server import SGLangServer, SGLangServerConfig, ServerError  # noqa: E402

pytestmark = pytest.mark.slow
PROMPTS = ["What is 3 plus 4?", "Compute 12 times 3.", "If x + 2 = 5 then", "A triangle has angles",
           "Divide 81 by 9", "The sum of the first", "What is", "Compute"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang")
    tokenizer = save_with_tokenizer(root / "model")
    config = SGLangServerConfig(str(root / "model"), device="cpu", dtype="float32", max_total_tokens=8192,
                                startup_timeout_s=300)
    with SGLangServer(config, root / "server.log") as srv:
        yield srv, tokenizer, root


@pytest.fixture(scope="module")
def rollout(server):
    srv, tokenizer, root = server
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    groups = SGLangEngine(srv.url).generate(prompts, 4, SamplingParams(temperature=1.0, max_new_tokens=16))
    return prompts, groups, root


def test_eight_prompts_times_four_samples(rollout):
    prompts, groups, _ = rollout
    assert [len(g) for g in groups] == [4] * 8
    for i, group in enumerate(groups):
        for s in group:
            assert s.prompt_index == i
            assert 1 <= len(s.output_ids) <= 16 and len(s.logprobs) == len(s.output_ids)
            assert s.finish_reason in ("stop", "length")
            assert all(lp <= 0 for lp in s.logprobs)
    assert len({tuple(s.output_ids) for g in groups for s in g}) > 8  # sampled, not greedy copies


@pytest.mark.parametrize("tp", [1, 2])
def test_sglang_logprobs_equal_the_megatron_policy(rollout, tmp_path, tp):
    prompts, groups, root = rollout
    samples = [{"prompt": prompts[s.prompt_index], "output": s.output_ids, "logprobs": s.logprobs}
               for g in groups for s in g]
    (tmp_path / "samples.json").write_text(json.dumps(samples))
    torchrun("rollout_parity_worker.py", tp, str(tmp_path / "out.json"), str(root / "model"),
             str(tmp_path / "samples.json"), str(tp))
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["tokens"] == sum(len(s["output"]) for s in samples)
    assert result["max_abs_diff"] < 1e-4


def test_sampling_params_are_validated():
    with pytest.raises(ValueError, match="rollout.temperature"):
        SamplingParams(temperature=0.0)
    with pytest.raises(ValueError, match="rollout.top_p"):
        SamplingParams(top_p=1.5)


def test_a_server_that_cannot_start_reports_its_log(tmp_path):
    config = SGLangServerConfig(str(tmp_path / "no_such_model"), device="cpu", startup_timeout_s=120)
    with pytest.raises(ServerError, match="exited with"):
        with SGLangServer(config, tmp_path / "server.log"):
            pass

