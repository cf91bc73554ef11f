"""A mixture of experts' routes from the rollout to the trainer: the in-process engine records the experts its
routers chose (TP = PP = EP = 1, a gloo world of one), SGLang's base64 field is read into the trainer's layout, and
the routes steer the trainer's routers token by token."""

import base64
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import one_process_runtime

sys.path.insert(0, str(Path(__file__).parent / "distributed"))
from tiny_models import PARITY_DTYPE, hf_model  # noqa: E402

from megatron_dapo.config import ConfigError, ParallelConfig, RolloutConfig  # noqa: E402
from megatron_dapo.rollout.engine import SamplingParams  # noqa: E402
from megatron_dapo.rollout.local_engine import LocalEngine  # noqa: E402
from megatron_dapo.rollout.routes import RouteLayout, RoutesError  # noqa: E402
from megatron_dapo.rollout.sglang_engine import parse_group  # noqa: E402

PROMPTS = [[5, 17, 3], [250, 4, 9, 9, 31, 2, 77], [1]]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """(policy built for replay, the same weights built without, spec, runtime, the engine's groups)."""
    from megatron_dapo.checkpoint.hf_weights import load_hf_weights
    from megatron_dapo.checkpoint.safetensors_io import HFCheckpoint
    from megatron_dapo.parallel.runtime import shutdown_runtime
    from megatron_dapo.policy.hf_config import model_spec_from_hf
    from megatron_dapo.policy.model import build_model

    parallel = ParallelConfig(device="cpu")
    runtime = one_process_runtime(parallel)
    hf, _ = hf_model("qwen3_moe", seed=3)
    folder = tmp_path_factory.mktemp("moe") / "hf"
    hf.save_pretrained(folder)
    ckpt = HFCheckpoint(folder)
    spec = model_spec_from_hf(ckpt.config)
    models = []
    for replay in (True, False):
        model = build_model(spec, parallel, pre_process=True, post_process=True, params_dtype=PARITY_DTYPE,
                            routing_replay=replay)
        load_hf_weights(model, ckpt.get, spec, parallel)
        models.append(model.eval())
    engine = LocalEngine(models[0], vocab_size=spec.vocab_size, max_positions=spec.max_position_embeddings,
                         eos_token_ids=[0], device=runtime.device, seed=1, record_routes=True)
    groups = engine.generate(PROMPTS, 3, SamplingParams(max_new_tokens=14, temperature=1.0))
    yield models[0], models[1], spec, runtime, engine, groups
    shutdown_runtime()


def sequences(groups, with_routes=True):
    from megatron_dapo.policy.batch import Sequence

    return [Sequence(torch.tensor(PROMPTS[s.prompt_index] + s.output_ids), len(PROMPTS[s.prompt_index]),
                     torch.from_numpy(s.routes) if with_routes else None) for g in groups for s in g]


def test_every_sample_carries_the_experts_of_every_position_the_engine_ran(moe):
    *_, spec, _, _, groups = moe
    for s in (s for g in groups for s in g):
        rows = len(PROMPTS[s.prompt_index]) + len(s.output_ids) - 1  # the last token is never run
        assert s.routes.shape == (rows, sum(spec.moe_layers), spec.moe_topk) and s.routes.dtype == np.uint8
        assert s.routes.max() < spec.num_experts
        assert all(len(set(r)) == spec.moe_topk for r in s.routes.reshape(-1, spec.moe_topk).tolist())


def test_the_trainers_own_routing_is_the_engines_and_replay_reproduces_its_logprobs(moe):
    """fp32, decisive routers: the trainer recomputing the samples by itself routes every token at every layer as
    the engine did; with the routes replayed, its log-probs are the engine's."""
    from megatron_dapo.policy.forward import response_logprobs
    from megatron_dapo.policy.routing_replay import routers_of

    replaying, plain, spec, runtime, _, groups = moe
    chosen = []
    hooks = [r.register_forward_hook(lambda _, __, out: chosen.append(out[1])) for r in routers_of(plain)]
    kwargs = dict(vocab_size=spec.vocab_size, max_positions=spec.max_position_embeddings,
                  max_tokens_per_micro_batch=10_000, device=runtime.device)
    seqs = sequences(groups)
    for i, seq in enumerate(seqs):  # one sequence per pass: the routers see it in its own order
        chosen.clear()
        response_logprobs(plain, [sequences(groups, with_routes=False)[i]], **kwargs)
        own = torch.stack([m.to(torch.int8).topk(spec.moe_topk).indices.sort().values for m in chosen], 1)
        assert torch.equal(own[: len(seq.routes)].cpu(), seq.routes.long()), f"sequence {i}: the routing differs"
    for h in hooks:
        h.remove()
    replayed = response_logprobs(replaying, seqs, **kwargs)
    engine = torch.tensor([lp for g in groups for s in g for lp in s.logprobs], dtype=torch.float64)
    assert (torch.cat([r[0] for r in replayed]).double().cpu() - engine).abs().max() < 1e-5


def test_the_engine_routes_by_itself_after_a_replayed_pass(moe):
    """The trained policy is left replaying the last micro-batch's routes: the engine still samples with its own
    routing (the same seed, the same samples and routes)."""
    from megatron_dapo.policy.forward import response_logprobs

    replaying, _, spec, runtime, engine, groups = moe
    response_logprobs(replaying, sequences(groups)[:1], vocab_size=spec.vocab_size,
                      max_positions=spec.max_position_embeddings, max_tokens_per_micro_batch=10_000,
                      device=runtime.device)
    engine.generator.manual_seed(1)
    again = engine.generate(PROMPTS, 3, SamplingParams(max_new_tokens=14, temperature=1.0))
    assert [[s.output_ids for s in g] for g in again] == [[s.output_ids for s in g] for g in groups]
    assert all(np.array_equal(a.routes, b.routes) for ga, gb in zip(again, groups) for a, b in zip(ga, gb))


def test_a_dense_model_has_no_routes_to_record(tmp_path):
    from megatron_dapo.policy.hf_config import model_spec_from_hf

    with pytest.raises(ConfigError, match="rollout.routing_replay: must be true or false"):
        RolloutConfig(routing_replay="yes")
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="rollout.routing_replay: the policy has no router to record"):
        LocalEngine(model, vocab_size=10, max_positions=10, eos_token_ids=[0], device=torch.device("cpu"),
                    record_routes=True)
    _, cfg = hf_model("qwen2")
    assert not model_spec_from_hf(cfg).is_moe


def sglang_output(routes: np.ndarray, prompt_len: int, output_ids: list[int]):
    return {"output_ids": output_ids, "meta_info": {
        "finish_reason": {"type": "stop"}, "output_token_logprobs": [[-0.5, t, None] for t in output_ids],
        "weight_version": "3", "routed_experts": base64.b64encode(routes.astype(np.int32).tobytes()).decode()}}


def test_sglangs_routes_are_read_into_the_moe_layers_smallest_type():
    """SGLang reports a row for every decoder layer (a dense one's is meaningless) of every position but the last,
    as int32; the trainer keeps the MoE layers' in the smallest id type."""
    layout = RouteLayout(num_layers=4, moe_layers=(True, False, True, True), topk=2, num_experts=128)
    prompt_len, output = 5, [11, 12, 13]
    rows = prompt_len + len(output) - 1
    full = np.arange(rows * 4 * 2).reshape(rows, 4, 2) % 128
    [sample] = parse_group(0, sglang_output(full, prompt_len, output), 1, layout, prompt_len)
    assert sample.routes.dtype == np.uint8 and np.array_equal(sample.routes, full[:, [0, 2, 3]])
    assert parse_group(0, sglang_output(full, prompt_len, output), 1)[0].routes is None  # replay off: not read
    wide = RouteLayout(num_layers=4, moe_layers=(True,) * 4, topk=2, num_experts=512)
    assert parse_group(0, sglang_output(full, prompt_len, output), 1, wide, prompt_len)[0].routes.dtype == np.int16
    with pytest.raises(RoutesError, match=r"prompt 0: 56 routed expert ids, expected 8 positions x 4 layers"):
        parse_group(0, sglang_output(full, prompt_len, output), 1, layout, prompt_len + 1)
    missing = sglang_output(full, prompt_len, output)
    del missing["meta_info"]["routed_experts"]
    with pytest.raises(RoutesError, match="prompt 0: the server returned no routes.*--enable-return-routed-experts"):
        parse_group(0, missing, 1, layout, prompt_len)
    with pytest.raises(RoutesError, match="prompt 0: expert ids 0..196 outside the model's 128 experts"):
        parse_group(0, sglang_output(np.arange(rows * 8).reshape(rows, 4, 2) * 4 % 200, prompt_len, output), 1,
                    layout, prompt_len)
