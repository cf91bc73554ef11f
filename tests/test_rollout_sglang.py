"""Rollouts from a real SGLang server on the CPU: grouped sampling, log-prob parity with the policy at the sampling
temperature, and the start-up check that refuses servers returning other log-probs."""

import dataclasses
import json
import os

import pytest
from conftest import sglang_server_as_started
from torchrun_launch import torchrun

from megatron_dapo.algorithm import AlgorithmConfig, PromptItem
from megatron_dapo.rollout.engine import SamplingParams, sample_seed
from megatron_dapo.rollout.sglang_engine import SGLangEngine
from megatron_dapo.rollout.sglang_server import SGLangServer, SGLangServerConfig, ServerError
from megatron_dapo.service.dynamic_sampler import DynamicSampler

pytestmark = pytest.mark.slow
PROMPTS = ["What is 3 plus 4?", "Compute 12 times 3.", "If x + 2 = 5 then", "A triangle has angles",
           "Divide 81 by 9", "The sum of the first", "What is", "Compute"]


@pytest.fixture(scope="module")
def server(shared_sglang):
    return sglang_server_as_started(shared_sglang)


class OriginalLogprobServer(SGLangServer):
    """A server started elsewhere with SGLANG_RETURN_ORIGINAL_LOGPROB=1: temperature-1 log-probs. Stopped as a GPU
    server is (SIGTERM, and its main process ends its children), which the suite sees nowhere else."""

    def environment(self):
        return {**super().environment(), "SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}

    def stops_gracefully(self) -> bool:
        return True


@pytest.fixture(scope="module")
def second_server(server, tmp_path_factory):
    """A second server on the shared one's model, for two tests that each need a server unlike the shared one
    (one start, not two): temperature-1 log-probs (OriginalLogprobServer), and samples that depend only on
    (request, seed), whatever else it has batched (without --enable-deterministic-inference SGLang ignores the
    per-sample seeds)."""
    _, _, root = server
    log = tmp_path_factory.mktemp("second_server") / "server.log"
    config = SGLangServerConfig(str(root / "model"), device="cpu", dtype="float32", max_total_tokens=8192,
                                startup_timeout_s=300, extra_args=["--enable-deterministic-inference"])
    with OriginalLogprobServer(config, log) as srv:
        yield srv
    # Its graceful stop: SGLang did not take a child's exit for a crash (which made it wait 5 s for diagnostics).
    assert "crashed" not in log.read_text()


@pytest.fixture(scope="module")
def rollouts(server):
    """Samples at temperature 1 and at 0.7: {temperature: (prompts, groups, model root)}."""
    srv, tokenizer, root = server
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    return {t: (prompts, SGLangEngine(srv.url).generate(prompts, 4, SamplingParams(temperature=t, max_new_tokens=16)),
                root) for t in (1.0, 0.7)}


@pytest.fixture(scope="module")
def rollout(rollouts):
    return rollouts[1.0]


@pytest.mark.smoke
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


@pytest.fixture(scope="module")
def recomputed(server, rollouts, tmp_path_factory):
    """tp -> the policy's recompute of both temperatures' samples at that TP: one start of its ranks for both."""
    _, _, root = server
    results = {}

    def at(tp: int) -> dict:
        if tp not in results:
            work = tmp_path_factory.mktemp(f"parity-tp{tp}")
            sampled = []
            for t, (prompts, groups, _) in rollouts.items():
                samples = [{"prompt": prompts[s.prompt_index], "output": s.output_ids, "logprobs": s.logprobs}
                           for g in groups for s in g]
                (work / f"samples-{t}.json").write_text(json.dumps(samples))
                sampled.append(f"{work / f'samples-{t}.json'}:{t}")
            torchrun("rollout_parity_worker.py", tp, str(work / "out.json"), str(root / "model"), str(tp), *sampled)
            results[tp] = json.loads((work / "out.json").read_text())
        return results[tp]

    return at


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("tp", [1, 2])
def test_sglang_logprobs_equal_the_megatron_policy(rollouts, recomputed, tp, temperature):
    """SGLang's log-probs of the tokens it sampled at `temperature` are the trainer's old log-probs: the policy's
    log_softmax(logits / temperature) (and, at 0.7, not the temperature-1 ones)."""
    _, groups, _ = rollouts[temperature]
    result = recomputed(tp)[str(temperature)]
    assert result["tokens"] == sum(len(s.output_ids) for g in groups for s in g)
    assert result["max_abs_diff"] < 1e-4
    if temperature != 1.0:
        assert result["max_abs_diff_untempered"] > 0.1


def test_a_cpu_server_forks_its_scheduler_and_detokenizer(server, second_server):
    """cpu_shim/dapo_cpu_fork.py: on the CPU, SGLang's children are forked from its launcher, not spawned to import
    everything again (the servers of every other test here serve through them)."""
    _, _, root = server
    for log in (root / "server.log", second_server.log_path):
        assert "CPU server: its scheduler and detokenizer are forked from the launcher" in log.read_text(), log


def test_servers_we_start_drop_sglang_return_original_logprob(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    server = SGLangServer(SGLangServerConfig("m", device="cpu"), tmp_path / "log")
    env = server.environment()
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB" not in env and env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert "--sleep-on-idle" in server.command()  # an idle CPU server does not spin on a core the trainer needs
    assert os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"  # the caller's own environment is left alone


def test_servers_given_by_url_are_checked_for_tempered_logprobs(server, second_server, tmp_path):
    """The start-up check (rollout/logprob_check.py) at PP=2, where global rank 0 holds the engine and the last
    stage the recomputation: the default server passes at 0.7; one with SGLANG_RETURN_ORIGINAL_LOGPROB=1 is refused
    at 0.7, naming the keys and the variable, and passes at 1.0, where the two agree."""
    srv, _, root = server
    original = second_server
    cases = [f"{srv.url}@0.7", f"{original.url}@0.7", f"{original.url}@1.0"]
    torchrun("logprob_check_worker.py", 2, str(tmp_path / "out.json"), str(root / "model"), "1", "2", *cases)
    result = json.loads((tmp_path / "out.json").read_text())
    good, bad, at_one = (result[c] for c in cases)
    assert all(r["same_on_every_rank"] and r["model_left_training"] for r in result.values())
    assert good["accepted"] and good["tokens"] >= 16, good
    assert good["diff_tempered"] < 1e-5 and good["diff_untempered"] > 0.01, good  # fp32 noise; what 0.7 moves
    assert not bad["accepted"]
    for words in ("rollout.server_urls", "rollout.temperature", "temperature-1 log-probs",
                  "SGLANG_RETURN_ORIGINAL_LOGPROB=1"):
        assert words in bad["message"], bad["message"]
    assert at_one["accepted"] and at_one["diff_tempered"] < 1e-5, at_one


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


# --- dynamic sampling against the real server: streaming and aborts keep the draw-order batch ---------------


def test_a_stop_string_ends_a_response_with_the_tokens_that_complete_it(server, second_server):
    """The response's ids run to the token whose text completes the stop string, that token included (its text is
    what the engine's tokens decode to, the tag a multi-turn rollout stops on); the draws before it are those of the
    same request without it (a deterministic server: samples depend only on the request and its seed)."""
    _, tokenizer, _ = server
    engine = SGLangEngine(second_server.url)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    try:
        free = engine.generate(prompts, 1, SamplingParams(max_new_tokens=24, seed=5, ignore_eos=True))
        picked = {}  # prompt -> (a stop string: the text of 3 of its response's tokens, the last one's position)
        for i, [sample] in enumerate(free):
            ids = sample.output_ids
            for k in range(2, len(ids)):  # the random model's text has partial characters: 3 whole tokens
                pieces = [tokenizer.decode([t]) for t in ids[k - 2:k + 1]]
                if all(piece and "\ufffd" not in piece for piece in pieces):
                    picked[i] = ("".join(pieces), k)
                    break
        assert len(picked) >= 2, picked
        stops = tuple(stop for stop, _ in picked.values())  # the same call (a sample's seed follows its prompt's place), all the stops
        cut = engine.generate(prompts, 1, SamplingParams(max_new_tokens=24, seed=5, ignore_eos=True, stop=stops))
    finally:
        engine.close()
    for i, ([before], [after]) in enumerate(zip(free, cut)):
        ids = after.output_ids
        assert ids == before.output_ids[:len(ids)] and len(after.logprobs) == len(ids)
        if after.finish_reason == "stop":
            assert any(s in tokenizer.decode(ids) for s in stops)
            assert not any(s in tokenizer.decode(ids[:-1]) for s in stops), (ids, stops)
        else:
            assert len(ids) == 24 and not any(s in tokenizer.decode(ids) for s in stops)
        if i in picked:
            assert after.finish_reason == "stop" and len(ids) <= picked[i][1] + 1, (picked[i], ids)


def test_dynamic_sampling_keeps_the_first_mixed_groups_in_draw_order(server, second_server):
    _, tokenizer, _ = server
    srv = second_server  # deterministic; its log-probs (temperature-1) are not looked at
    texts = PROMPTS + ["Add 5 and 6", "Subtract 4 from 10", "Half of 18 is", "Twice 7 is"]
    prompts = [PromptItem(i, tokenizer.encode(t), "") for i, t in enumerate(texts)]
    # Ten stop tokens of 296: responses of 1 to 64 tokens. "Correct": an even first token.
    params = SamplingParams(max_new_tokens=64, stop_token_ids=list(range(3, 300, 30)), seed=1234)

    def score(groups):
        return [[s.output_ids[0] % 2 == 0 for s in samples] for _, samples in groups]

    cfg = AlgorithmConfig(batch_size=4, group_size=4, oversample_factor=3.0, max_sampling_rounds=1,
                          max_response_len=64, overlong_cache_len=16)
    engine = SGLangEngine(srv.url)
    batch = DynamicSampler(engine, score, lambda k: prompts[:k], cfg, params).collect()

    # The same 12 prompts generated whole, with round 1's seeds: the batch is their first 4 mixed groups.
    full = engine.generate([p.token_ids for p in prompts], 4, dataclasses.replace(params, seed=sample_seed(1234, 1)))
    mixed = [i for i, g in enumerate(full) if 0 < sum(score([(None, g)])[0]) < 4]
    assert len(mixed) >= 5
    assert [g.prompt.index for g in batch.groups] == mixed[:4]
    assert [[s.output_ids for s in g.samples] for g in batch.groups] == [[s.output_ids for s in full[i]]
                                                                         for i in mixed[:4]]
    m = batch.metrics
    assert m.groups_settled == mixed[3] + 1 and m.groups_generated + m.groups_aborted == len(prompts)
    # Not what the first groups to complete would give: the 4 mixed groups whose longest response is shortest.
    longest = {i: max(len(s.output_ids) for s in full[i]) for i in mixed}
    assert set(sorted(mixed, key=longest.get)[:4]) != set(mixed[:4])


def test_the_mismatch_command_prints_its_table_and_fails_past_its_threshold_when_the_server_holds_other_weights(
        server, tmp_path):
    """Issue 52: `megatron-dapo mismatch` samples the run's own prompts from a real CPU server, recomputes them with
    the trainer's policy (fp32 here, as the server) and prints the mismatch by response position; with the server
    holding other weights (the same tokenizer) the mean |log-ratio| is far past the threshold and it exits 1."""
    import subprocess
    import sys

    import yaml
    from tiny_models import save_with_tokenizer

    from megatron_dapo.data.prompt_file import write_rows
    from megatron_dapo.data.synthetic_math import generate_rows
    from megatron_dapo.rollout.sglang_server import post_json

    srv, _, root = server
    write_rows(tmp_path / "train.jsonl", generate_rows(8, 0, digits=1))
    cfg = {"model": {"path": str(root / "model"), "dtype": "float32"},
           "data": {"train_path": str(tmp_path / "train.jsonl"), "chat_template": False},
           "rollout": {"server_urls": [srv.url], "temperature": 0.8}, "parallel": {"device": "cpu"},
           "train": {"output_dir": str(tmp_path / "run")}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))

    def mismatch(name):
        done = subprocess.run([sys.executable, "-m", "megatron_dapo.cli", "mismatch", str(tmp_path / "run.yaml"),
                               "--prompts", "4", "--samples", "2", "--max-new-tokens", "40", "--json",
                               str(tmp_path / f"{name}.json")], capture_output=True, text=True, timeout=600)
        assert (tmp_path / f"{name}.json").exists(), done.stderr[-3000:]
        return done, json.loads((tmp_path / f"{name}.json").read_text())

    done, same = mismatch("same")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| positions | tokens | mean abs log-ratio |" in done.stdout and "within the threshold 0.05" in done.stdout
    every = same["rows"][-1]
    assert every["positions"] == "all" and every["tokens"] >= 16 and same["ok"]
    assert every["abs_max"] < 1e-4 and every["icepop_masked"] == 0, every  # fp32 both sides
    assert [r["positions"] for r in same["rows"][:2]] == ["0-15", "16-63"]

    save_with_tokenizer(tmp_path / "other", seed=1)
    assert post_json(f"{srv.url}/update_weights_from_disk", {"model_path": str(tmp_path / "other"),
                                                             "weight_version": "other"}, 300)["success"]
    try:
        done, other = mismatch("other")
    finally:
        sglang_server_as_started((srv, None, root))
    assert done.returncode == 1, done.stderr[-3000:]
    assert "PAST the threshold 0.05" in done.stdout and not other["ok"]
    assert other["rows"][-1]["abs_mean"] > 0.1 and other["rows"][-1]["k3"] > 0.01, other["rows"][-1]
