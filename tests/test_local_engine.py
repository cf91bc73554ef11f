"""The in-process engine: samples from the live Megatron policy (TP = PP = 1, gloo world of one)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "distributed"))
from tiny_models import PARITY_DTYPE, VOCAB, hf_model  # noqa: E402

from megatron_dapo.config import ConfigError, ParallelConfig  # noqa: E402
from megatron_dapo.rollout.engine import SamplingParams  # noqa: E402
from megatron_dapo.rollout.local_engine import LocalEngine, hf_eos_token_ids, sample_tokens  # noqa: E402

EOS = [7]
PROMPT_LENGTHS = (3, 11, 6, 1, 17)


@pytest.fixture(scope="module")
def policy():
    """(megatron stage, its spec, runtime, the transformers model with the same weights)."""
    from megatron_dapo.checkpoint.hf_weights import load_hf_weights
    from megatron_dapo.parallel.runtime import free_port, init_runtime, shutdown_runtime
    from megatron_dapo.policy.hf_config import model_spec_from_hf
    from megatron_dapo.policy.model import build_model

    parallel = ParallelConfig(device="cpu")
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    runtime = init_runtime(parallel, environ=env)
    hf, cfg = hf_model("qwen2", seed=2)
    spec = model_spec_from_hf(cfg)
    model = build_model(spec, parallel, pre_process=True, post_process=True, params_dtype=PARITY_DTYPE)
    load_hf_weights(model, hf.state_dict().__getitem__, spec, parallel)
    yield model, spec, runtime, hf
    shutdown_runtime()


def make_engine(policy, seed=0, **kwargs):
    model, spec, runtime, _ = policy
    return LocalEngine(model, vocab_size=spec.vocab_size, max_positions=spec.max_position_embeddings,
                       eos_token_ids=kwargs.pop("eos", EOS), device=runtime.device, seed=seed, **kwargs)


def prompts(lengths=PROMPT_LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def as_sequences(ps, samples):
    from megatron_dapo.policy.batch import Sequence

    return [Sequence(torch.tensor(ps[s.prompt_index] + s.output_ids), len(ps[s.prompt_index])) for s in samples]


def recomputed_logprobs(policy, ps, samples, model=None, temperature=1.0, entropies=False):
    """The policy's log-probs of the samples' tokens at `temperature` (with `entropies`: (log-probs, entropies))."""
    from megatron_dapo.policy.forward import response_logprobs

    _, spec, runtime, _ = policy
    model = model or policy[0]
    seqs = as_sequences(ps, samples)
    model.eval()
    out = response_logprobs(model, seqs, vocab_size=spec.vocab_size, max_positions=spec.max_position_embeddings,
                            max_tokens_per_micro_batch=1024, device=runtime.device, temperature=temperature)
    model.train()
    return [(o[0].cpu(), o[1].cpu()) if entropies else o[0].cpu() for o in out]


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8), (1.5, 0.95)])
def test_sampled_token_frequencies_follow_the_tempered_top_p_distribution(temperature, top_p):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])
    probs = torch.softmax(logits.double() / temperature, dim=0)  # sorted already
    probs[(probs.cumsum(0) - probs) > top_p] = 0  # SGLang's rule: keep tokens until the mass reaches top_p
    probs /= probs.sum()
    rows = 200_000
    token, logp, entropy = sample_tokens(logits.expand(rows, -1),
                                         SamplingParams(temperature=temperature, top_p=top_p),
                                         torch.Generator().manual_seed(0))
    freq = torch.bincount(token, minlength=6).double() / rows
    assert (freq - probs).abs().max() < 0.005  # about 5 standard deviations
    assert (freq[probs == 0] == 0).all()
    # SGLang's default: log_softmax(logits / T) of the sampled token, before the top_p cut
    assert torch.allclose(logp, torch.log_softmax(logits / temperature, dim=0)[token])
    # ... and the entropy of that distribution, the one whose log-probs are returned
    tempered = torch.softmax(logits.double() / temperature, dim=0)
    assert torch.allclose(entropy.double(), -(tempered * tempered.log()).sum().expand(rows), atol=1e-6)


def test_greedy_returns_the_temperature_one_logprob_as_sglang():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0], [0.0, -1.0, 3.0, 1.0]])
    token, logp, _ = sample_tokens(logits, SamplingParams(temperature=1e-7), torch.Generator().manual_seed(0))
    assert token.tolist() == [0, 2]
    assert torch.equal(logp, torch.log_softmax(logits, dim=-1)[[0, 1], token])


@pytest.mark.parametrize("temperature,top_p,max_batch_rows", [(1.0, 1.0, 256), (0.7, 1.0, 256), (0.7, 0.9, 256),
                                                             (1.0, 1.0, 8)])
def test_logprobs_equal_the_policy_recomputing_the_samples(policy, temperature, top_p, max_batch_rows):
    """The sampled tokens' log-probs at the sampling temperature (before any top_p cut, as SGLang's), what the policy
    recomputes at that temperature; rows of different prompt lengths, rows dropped from the KV cache as they stop,
    and batches of rows smaller than the request."""
    ps = prompts()
    engine = make_engine(policy, max_batch_tokens=max_batch_rows * (max(PROMPT_LENGTHS) + 24),
                         eos=list(range(0, VOCAB, 29)))
    groups = engine.generate(ps, 4, SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=24))
    assert [len(g) for g in groups] == [4] * len(ps)
    assert all(s.prompt_index == i for i, g in enumerate(groups) for s in g)
    samples = [s for g in groups for s in g]
    assert {s.finish_reason for s in samples} == {"stop", "length"}  # some rows left the batch early
    assert len({tuple(s.output_ids) for s in samples}) > len(ps)
    untempered = recomputed_logprobs(policy, ps, samples)
    for s, (ref, entropy) in zip(samples, recomputed_logprobs(policy, ps, samples, temperature=temperature,
                                                            entropies=True)):
        assert len(s.logprobs) == len(s.output_ids) == ref.numel()
        assert (torch.tensor(s.logprobs, dtype=torch.float64) - ref.double()).abs().max() < 1e-5
        assert s.entropy_sum == pytest.approx(entropy.double().sum().item(), rel=1e-5)  # every token's, summed
    if temperature != 1.0:  # the comparison tells the temperatures apart
        assert max((torch.tensor(s.logprobs) - ref).abs().max().item() for s, ref in zip(samples, untempered)) > 0.1


def test_samples_come_from_the_weights_the_trainer_just_updated(policy):
    """The engine over the trainer's DDP-wrapped model: after an optimizer step, no sync, the new policy samples."""
    from megatron_dapo.checkpoint.hf_weights import load_policy_weights
    from megatron_dapo.config import LossConfig, OptimConfig
    from megatron_dapo.policy.train_step import PolicyTrainer, RolloutSample

    _, spec, runtime, hf = policy
    parallel = ParallelConfig(device="cpu")
    trainer = PolicyTrainer(spec, parallel, runtime.device, OptimConfig(lr=1e-2, warmup_steps=0), LossConfig(), 2048,
                            params_dtype=PARITY_DTYPE)
    load_policy_weights(trainer, hf.state_dict().__getitem__)
    engine = LocalEngine(trainer.model, vocab_size=spec.vocab_size, max_positions=spec.max_position_embeddings,
                         eos_token_ids=EOS, device=runtime.device)
    ps, params = prompts(), SamplingParams(max_new_tokens=12)
    before = [s for g in engine.generate(ps, 2, params) for s in g]
    trainer.step([RolloutSample(seq, torch.tensor(s.logprobs), torch.full((seq.response_len,), 1.0 - 2 * (i % 2)),
                                torch.ones(seq.response_len, dtype=torch.bool))
                  for i, (s, seq) in enumerate(zip(before, as_sequences(ps, before)))])
    engine.weight_version = "1"
    after = [s for g in engine.generate(ps, 2, params) for s in g]
    assert {s.weight_version for s in after} == {"1"}
    for s, ref in zip(after, recomputed_logprobs(policy, ps, after, trainer.module)):
        assert (torch.tensor(s.logprobs, dtype=torch.float64) - ref.double()).abs().max() < 1e-5
    stale = max((torch.tensor(s.logprobs) - ref).abs().max().item()
                for s, ref in zip(before, recomputed_logprobs(policy, ps, before, trainer.module)))
    assert stale > 1e-3, "the step did not change the policy"


@torch.no_grad()
def hf_greedy(hf, prompt, steps):
    ids = torch.tensor([prompt])
    for _ in range(steps):
        ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


@pytest.mark.parametrize("temperature", [1e-4, 1e-7])  # sampled from a near one-hot distribution; argmax
def test_low_temperature_decodes_like_transformers_argmax(policy, temperature):
    hf = policy[3]
    ps = prompts(seed=5)
    groups = make_engine(policy).generate(ps, 2, SamplingParams(temperature=temperature, max_new_tokens=20,
                                                                ignore_eos=True))
    for p, group in zip(ps, groups):
        expected = hf_greedy(hf, p, 20)
        assert [s.output_ids for s in group] == [expected, expected]
        assert all(s.finish_reason == "length" for s in group)
    if temperature < 1e-6:  # greedy: the temperature-1 log-probs, as SGLang returns for greedy requests
        samples = [s for g in groups for s in g]
        for s, ref in zip(samples, recomputed_logprobs(policy, ps, samples)):
            assert (torch.tensor(s.logprobs, dtype=torch.float64) - ref.double()).abs().max() < 1e-5


def test_stop_tokens_eos_and_max_new_tokens(policy):
    stop_ids, eos = list(range(1, VOCAB, 23)), list(range(2, VOCAB, 23))
    ends = set(stop_ids) | set(eos)
    engine = make_engine(policy, seed=1, eos=eos)
    groups = engine.generate(prompts(), 8, SamplingParams(max_new_tokens=15, stop_token_ids=stop_ids))
    samples = [s for g in groups for s in g]
    for s in samples:
        assert not ends & set(s.output_ids[:-1])
        if s.finish_reason == "stop":
            assert s.output_ids[-1] in ends and len(s.output_ids) <= 15
        else:
            assert s.finish_reason == "length" and len(s.output_ids) == 15 and s.output_ids[-1] not in ends
    last = {s.output_ids[-1] for s in samples if s.finish_reason == "stop"}
    assert last & set(stop_ids) and last & set(eos)  # both kinds of end were seen
    assert any(s.finish_reason == "length" for s in samples)

    fixed = engine.generate(prompts(), 8, SamplingParams(max_new_tokens=15, stop_token_ids=stop_ids, ignore_eos=True))
    assert all(len(s.output_ids) == 15 and s.finish_reason == "length" for g in fixed for s in g)


def letters(ids: list[int]) -> str:
    """A stand-in tokenizer's decode for the random-token model: token i is one letter, token 0 none."""
    return "".join(chr(ord("a") + (i - 1) % 26) for i in ids if i)


def test_a_stop_string_ends_a_response_with_the_token_that_completes_it(policy):
    """As SGLang returns it: the response's tokens run to the one whose text completes the first stop string in
    the response's text, that token included; the string is found across token boundaries, and ignore_eos does not
    turn it off."""
    engine = make_engine(policy, seed=1, eos=[], decode=letters)
    for i, prompt in enumerate(prompts()):  # one row a call: a stopped row changes the draws of the others
        free = engine.generate([prompt], 1, SamplingParams(max_new_tokens=24, seed=i))[0][0]
        stop = ("qq", letters(free.output_ids)[5:8])  # three letters of its text (tokens 5 to 7), and a pair
        after = engine.generate([prompt], 1, SamplingParams(max_new_tokens=24, seed=i, stop=stop,
                                                            ignore_eos=True))[0][0]
        cut = len(after.output_ids)
        assert after.output_ids == free.output_ids[:cut] and after.logprobs == free.logprobs[:cut]  # same draws
        assert after.finish_reason == "stop" and cut <= 8
        assert any(x in letters(after.output_ids) for x in stop)
        assert not any(x in letters(after.output_ids[:-1]) for x in stop)


def test_stop_strings_need_the_tokenizer(policy):
    with pytest.raises(ValueError, match="SamplingParams.stop: this LocalEngine was built without `decode`"):
        make_engine(policy).generate(prompts(), 1, SamplingParams(stop=("ab",)))
    with pytest.raises(ValueError, match="stop: must be non-empty strings"):
        SamplingParams(stop=("",))


def test_responses_end_at_the_models_max_positions(policy):
    max_pos = policy[1].max_position_embeddings
    ps = prompts(lengths=(max_pos - 3, 4))
    groups = make_engine(policy).generate(ps, 2, SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert [len(s.output_ids) for s in groups[0]] == [3, 3] and [len(s.output_ids) for s in groups[1]] == [10, 10]
    assert all(s.finish_reason == "length" for g in groups for s in g)


def test_same_seed_same_samples_and_the_set_weight_version(policy):
    params = SamplingParams(max_new_tokens=12)
    a = make_engine(policy, seed=11)
    a.weight_version = "7"
    first = a.generate(prompts(), 3, params)
    second = make_engine(policy, seed=11).generate(prompts(), 3, params)
    other = make_engine(policy, seed=12).generate(prompts(), 3, params)
    ids = [[s.output_ids for s in g] for g in first]
    assert ids == [[s.output_ids for s in g] for g in second]
    assert ids != [[s.output_ids for s in g] for g in other]
    assert {s.weight_version for g in first for s in g} == {"7"}
    assert {s.weight_version for g in second for s in g} == {"0"}


def test_stream_hands_out_whole_groups_and_abort_ends_it(policy):
    model = policy[0]
    model.train()
    engine = make_engine(policy, eos=list(range(0, VOCAB, 17)))
    stream = engine.stream(prompts(), 4, SamplingParams(max_new_tokens=30))
    it = iter(stream)
    group = next(it)
    assert len(group) == 4 and len({s.prompt_index for s in group}) == 1
    stream.abort()
    stream.abort()
    assert list(it) == []
    assert model.training  # sampling switched to eval mode only for its own forwards

    untouched = engine.stream(prompts(), 4, SamplingParams(max_new_tokens=30))
    untouched.abort()
    assert list(untouched) == []
    complete = list(engine.stream(prompts(), 4, SamplingParams(max_new_tokens=30)))
    assert sorted(g[0].prompt_index for g in complete) == list(range(len(PROMPT_LENGTHS)))


def test_cancelled_groups_leave_the_batch_and_the_others_are_handed_out(policy):
    engine = make_engine(policy, max_batch_tokens=8 * (max(PROMPT_LENGTHS) + 30))  # two prompts (8 rows) a batch
    shapes, logits = [], engine._logits
    engine._logits = lambda tokens, start, context: shapes.append(tuple(tokens.shape)) or logits(tokens, start, context)
    stream = engine.stream(prompts(), 4, SamplingParams(max_new_tokens=30, ignore_eos=True))
    stream.abort([3])  # before it started: never decoded, so the batches are [0, 1] and [2, 4]
    got = []
    for group in stream:
        got.append(group)
        if len(got) == 1:  # prompt 0 (3 tokens) ends before prompt 1 (11 tokens)
            stream.abort([0, 1])  # 0 was handed out already; 1 is mid-decode
            after = len(shapes)
    assert [g[0].prompt_index for g in got] == [0, 2, 4]
    assert all(len(g) == 4 and all(len(s.output_ids) == 30 for s in g) for g in got)
    # No more decode steps for prompt 1: the next forward is the prefill of the batch [2, 4] (8 rows, 6 tokens).
    assert shapes[after] == (8, 6) and shapes[0] == (8, 3)


def test_bad_requests_are_refused_by_name(policy):
    engine = make_engine(policy)
    params = SamplingParams(max_new_tokens=4)
    with pytest.raises(ValueError, match="n: the group size must be a whole number >= 1"):
        engine.generate(prompts(), 0, params)
    with pytest.raises(ValueError, match=r"prompts\[1\]: 0 tokens"):
        engine.generate([[1, 2], []], 1, params)
    with pytest.raises(ValueError, match=r"prompts\[0\]: token ids must be in \[0, 300\)"):
        engine.generate([[1, VOCAB]], 1, params)
    with pytest.raises(ValueError, match=r"prompts\[0\]: 96 tokens"):
        engine.generate([[1] * 96], 1, params)
    with pytest.raises(ConfigError, match="eos_token_id"):
        hf_eos_token_ids({"vocab_size": VOCAB})
    assert hf_eos_token_ids({"eos_token_id": [3, 4]}) == [3, 4] and hf_eos_token_ids({"eos_token_id": 5}) == [5]
