"""Packed micro-batches (model.packing): whole sequences end to end in one row, each attending to itself only, with
positions restarting per sequence. In one gloo process, fp32: the log-probs and entropies are the padded blocks'
whatever the budget, no sequence sees its neighbours, and a mixture of experts' replayed routes stay on their tokens.
Gradients at TP / PP / DP / SP splits: tests/test_policy_training.py."""

import sys
from pathlib import Path

import pytest
import torch
from conftest import one_process_runtime

sys.path.insert(0, str(Path(__file__).parent / "distributed"))
from tiny_models import PARITY_DTYPE, hf_model  # noqa: E402

from megatron_dapo.config import ConfigError, ModelConfig, ParallelConfig  # noqa: E402
from megatron_dapo.policy.batch import Sequence, micro_batches, plan_micro_batches  # noqa: E402

LENGTHS = ((5, 20), (3, 41), (9, 4), (2, 60), (7, 13), (4, 30))  # (prompt, response)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind -> (model, spec, runtime); the mixture of experts' model replays the routes its sequences carry."""
    from megatron_dapo.checkpoint.hf_weights import load_hf_weights
    from megatron_dapo.checkpoint.safetensors_io import HFCheckpoint
    from megatron_dapo.parallel.runtime import shutdown_runtime
    from megatron_dapo.policy.hf_config import model_spec_from_hf
    from megatron_dapo.policy.model import build_model

    parallel = ParallelConfig(device="cpu")
    runtime = one_process_runtime(parallel)
    built = {}
    for kind, replay in (("qwen2", False), ("qwen3_moe", True)):
        folder = tmp_path_factory.mktemp(kind)
        hf_model(kind)[0].save_pretrained(folder)
        ckpt = HFCheckpoint(folder)
        spec = model_spec_from_hf(ckpt.config)
        model = build_model(spec, parallel, pre_process=True, post_process=True, params_dtype=PARITY_DTYPE,
                            routing_replay=replay)
        load_hf_weights(model, ckpt.get, spec, parallel)
        built[kind] = (model.eval(), spec, runtime)
    yield built
    shutdown_runtime()


def sequences(seed: int = 0, spec=None) -> list[Sequence]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for p, r in LENGTHS:
        routes = None
        if spec is not None:  # random experts, distinct per position: replay must put each on its own token
            scores = torch.rand(p + r - 1, sum(spec.moe_layers), spec.num_experts, generator=g)
            routes = scores.topk(spec.moe_topk, dim=-1).indices
        out.append(Sequence(torch.randint(1, 300, (p + r,), generator=g), p, routes))
    return out


def logprobs(models, kind, seqs, budget, packed):
    from megatron_dapo.policy.forward import response_logprobs

    model, spec, runtime = models[kind]
    return response_logprobs(model, seqs, vocab_size=spec.vocab_size, max_positions=spec.max_position_embeddings,
                             max_tokens_per_micro_batch=budget, device=runtime.device, packed=packed)


def max_diff(a, b, which=0) -> float:
    return max((x[which] - y[which]).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("budget", [1000, 80, 62])
def test_packed_logprobs_and_entropies_are_the_padded_ones(models, budget):
    seqs = sequences()
    padded = logprobs(models, "qwen2", seqs, 1000, packed=False)
    packed = logprobs(models, "qwen2", seqs, budget, packed=True)
    assert len(micro_batches(seqs, budget, packed=True)) == {1000: 1, 80: 3, 62: 4}[budget]
    assert max_diff(packed, padded) < 1e-5 and max_diff(packed, padded, 1) < 1e-5


def test_a_sequence_never_attends_across_its_neighbours_in_a_pack(models):
    seqs = sequences()
    changed = list(seqs)
    changed[2] = Sequence(torch.flip(seqs[2].tokens, [0]), seqs[2].prompt_len)  # its prompt and response
    before = logprobs(models, "qwen2", seqs, 1000, packed=True)
    after = logprobs(models, "qwen2", changed, 1000, packed=True)
    assert len(micro_batches(seqs, 1000, packed=True)) == 1  # all in one pack
    assert (before[2][0] - after[2][0]).abs().max() > 1e-2
    for i in set(range(len(seqs))) - {2}:
        assert (before[i][0] - after[i][0]).abs().max() < 1e-6, i


def test_replayed_routes_stay_on_their_tokens_in_packs(models):
    """Each sequence's own random routes: packed (one pack, or several) the log-probs are the padded blocks';
    a route shifted by one token, or another sequence's, would change them (without replay they differ)."""
    _, spec, _ = models["qwen3_moe"]
    seqs = sequences(spec=spec)
    padded = logprobs(models, "qwen3_moe", seqs, 1000, packed=False)
    assert max_diff(logprobs(models, "qwen3_moe", seqs, 1000, packed=True), padded) < 1e-5
    assert max_diff(logprobs(models, "qwen3_moe", seqs, 62, packed=True), padded) < 1e-5
    shifted = [Sequence(s.tokens, s.prompt_len, s.routes.roll(1, dims=0)) for s in seqs]
    assert max_diff(logprobs(models, "qwen3_moe", shifted, 1000, packed=True), padded) > 1e-3


def test_after_a_forward_only_pass_the_routers_hold_no_routes(models):
    """Issue 50, finding 5: every micro-batch's routes stayed in each router (int64, on the host) until the next
    pass began, and a forward-only pass queued them for a backward that never comes: at the 30B config 10-35 GB a
    rank. Now a pass without recompute queues nothing, and each pass ends with its routers emptied."""
    from megatron_dapo.policy.routing_replay import routers_of

    model, spec, _ = models["qwen3_moe"]
    assert logprobs(models, "qwen3_moe", sequences(spec=spec), 62, packed=True)
    replays = [r.router_replay for r in routers_of(model)]
    assert len(replays) == sum(spec.moe_layers)
    held = [(r.target_topk_idx is not None, len(r.replay_backward_list), r.router_replay_action) for r in replays]
    assert held == [(False, 0, None)] * len(replays)


@pytest.mark.parametrize("packed", [False, True])
def test_padding_is_routed_round_robin_over_the_experts(models, packed):
    """Issue 50, finding 5: padding positions (and filler micro-batches) were all routed to experts 0..k-1, so they
    all landed on the first expert-parallel rank; now k distinct experts each, round robin over all of them. The
    sequences' own positions keep their routes."""
    from megatron_dapo.policy.batch import make_micro_batch
    from megatron_dapo.policy.routing_replay import RouteReplayer

    model, spec, _ = models["qwen3_moe"]
    seqs = sequences(spec=spec)
    replayer = RouteReplayer(model)
    try:
        for mb in [*micro_batches(seqs, 1000, packed=packed), make_micro_batch(seqs, [], 8)]:  # blocks; a filler
            replayer.before_forward(mb, recompute=False)
            target = replayer.routers[0].router_replay.target_topk_idx.cpu()  # [length x rows, k], sequence-major
            fill = mb.route_fill if mb.sample_index else torch.ones(mb.input_ids.shape, dtype=torch.bool)
            fill = fill.transpose(0, 1).reshape(-1)
            padding = target[fill]
            assert set(padding.flatten().tolist()) == set(range(spec.num_experts))
            assert (padding.sort(-1).values.diff(dim=-1) > 0).all()  # k distinct experts a position
            if mb.sample_index:
                own = mb.routes[:, :, replayer.layers[0]].transpose(0, 1).reshape(-1, spec.moe_topk)
                assert fill.sum() > 0 and torch.equal(target[~fill], own[~fill].long())
    finally:
        replayer.end()


def test_the_expert_load_counts_the_routes_each_router_took_in_a_pass_with_a_graph(models):
    """policy/expert_load.py: per MoE layer, the tokens each expert got (here the replayed routes, padding spread),
    counted in forwards that build a graph only (a recompute's first forward builds none)."""
    from megatron_dapo.policy.batch import micro_batches
    from megatron_dapo.policy.expert_load import ExpertLoad
    from megatron_dapo.policy.forward import model_forward
    from megatron_dapo.policy.routing_replay import RouteReplayer

    model, spec, runtime = models["qwen3_moe"]
    seqs = sequences(spec=spec)
    [mb] = micro_batches(seqs, 1000)
    replayer = RouteReplayer(model)
    try:
        with ExpertLoad(model) as load:
            replayer.before_forward(mb, recompute=False)
            with torch.no_grad():
                model_forward(model, mb, runtime.device)
            assert load.counts.sum() == 0
            with torch.enable_grad():
                model_forward(model, mb, runtime.device)
        taken = [r.router_replay.target_topk_idx.cpu() for r in replayer.routers]
    finally:
        replayer.end()
    assert len(taken) == load.counts.shape[0] == sum(spec.moe_layers)
    for layer, t in zip(load.counts.cpu(), taken):
        assert torch.equal(layer, torch.bincount(t.flatten(), minlength=spec.num_experts).double())
    expected = [(c.max() / c.mean()).item() for c in load.counts.cpu()]
    assert load.max_over_mean() == pytest.approx(expected) and all(1 <= v <= spec.num_experts for v in expected)


def own_routes(models, seqs) -> list[torch.Tensor]:
    """Each sequence's routes as the model's routers choose them by themselves, [tokens, MoE layers, k]."""
    from megatron_dapo.policy.forward import model_forward
    from megatron_dapo.policy.routing_replay import routers_of

    model, spec, runtime = models["qwen3_moe"]
    taken = []
    hooks = [r.register_forward_hook(lambda _r, _a, out: taken.append(out[1].nonzero()[:, 1].view(-1, spec.moe_topk)))
             for r in routers_of(model)]
    out = []
    try:
        for s in seqs:
            taken.clear()
            with torch.no_grad():
                model_forward(model, micro_batches([Sequence(s.tokens, s.prompt_len)], 1000)[0], runtime.device)
            out.append(torch.stack(taken, 1).cpu())
    finally:
        for h in hooks:
            h.remove()
    return out


def changed_last_layer(models):
    """(the sequences with their own routes, the same with the last MoE layer's routes changed at some positions,
    the routing agreement expected per MoE layer for the latter, the response tokens counted). Nothing routes after
    the last MoE layer, so the other layers keep their own routes; a sequence's prompt positions and its last token
    give no response log-prob, so changes there do not count."""
    _, spec, _ = models["qwen3_moe"]
    seqs = sequences()
    last, changed, counted = sum(spec.moe_layers) - 1, 0, 0
    own, altered = [], []
    for i, (s, routes) in enumerate(zip(seqs, own_routes(models, seqs))):
        own.append(Sequence(s.tokens, s.prompt_len, routes))
        routes = routes.clone()
        p, n = s.prompt_len, s.tokens.numel()
        at = [0, p - 1, p + (i % 3), n - 1]  # a prompt position, two response tokens' positions, the last token
        routes[at, last] = (routes[at, last] + 1) % spec.num_experts
        changed += len({p - 1, p + (i % 3)} & set(range(p - 1, n - 1)))
        counted += n - p
        altered.append(Sequence(s.tokens, p, routes))
    return own, altered, [1.0] * last + [pytest.approx(1 - changed / counted, abs=1e-12)], counted


@pytest.mark.parametrize("budget, packed", [(1000, False), (1000, True), (62, True)])
def test_routing_agreement_counts_the_response_tokens_whose_own_top_k_is_the_rollouts(models, budget, packed):
    """Issue 50, MoE observability (R3), in the old-log-prob pass: with the routers' own routes replayed the
    agreement is 1 in every layer; with the last MoE layer's routes changed at some positions it drops there by the
    share of response tokens changed."""
    from megatron_dapo.policy.forward import response_logprobs
    from megatron_dapo.policy.routing_agreement import RoutingAgreement

    model, spec, runtime = models["qwen3_moe"]
    own, altered, expected, counted = changed_last_layer(models)

    def agreement(seqs):
        with_routes = RoutingAgreement(model)
        response_logprobs(model, seqs, vocab_size=spec.vocab_size, max_positions=spec.max_position_embeddings,
                          max_tokens_per_micro_batch=budget, device=runtime.device, packed=packed,
                          agreement=with_routes)
        assert with_routes.counts[1].tolist() == [float(counted)] * len(expected)
        return with_routes.shares()

    assert agreement(own) == [1.0] * len(expected)
    assert agreement(altered) == expected


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_an_updates_routing_agreement_counts_each_token_once_with_activation_recompute(models, tmp_path, recompute,
                                                                                       monkeypatch):
    """Where nothing is recomputed (loss.old_logprobs rollout) the step's first update counts the agreement: the
    same as the old-log-prob pass, each response token once though activation recompute runs its forward again."""
    from megatron_dapo.checkpoint.hf_weights import load_policy_weights
    from megatron_dapo.checkpoint.safetensors_io import HFCheckpoint
    from megatron_dapo.config import LossConfig, OptimConfig
    from megatron_dapo.policy import train_step
    from megatron_dapo.policy.train_step import PolicyTrainer, RolloutSample

    made = []

    class Kept(train_step.RoutingAgreement):
        def __init__(self, *args):
            super().__init__(*args)
            made.append(self)

    monkeypatch.setattr(train_step, "RoutingAgreement", Kept)
    _, spec, runtime = models["qwen3_moe"]
    _, altered, expected, counted = changed_last_layer(models)
    hf_model("qwen3_moe")[0].save_pretrained(tmp_path)  # the fixture's weights
    trainer = PolicyTrainer(spec, ParallelConfig(device="cpu"), runtime.device, OptimConfig(lr=1e-6, warmup_steps=0),
                            LossConfig(), 62, activation_recompute=recompute, params_dtype=PARITY_DTYPE,
                            routing_replay=True, packed=True)
    load_policy_weights(trainer, HFCheckpoint(tmp_path).get)
    batch = [RolloutSample(s, torch.full((s.response_len,), -2.0), torch.ones(s.response_len),
                           torch.ones(s.response_len, dtype=torch.bool)) for s in altered]
    assert trainer.step(batch, measure_routing=True).routing_agreement == expected
    assert made[0].counts[1].tolist() == [float(counted)] * len(expected)
    assert trainer.step(batch).routing_agreement is None and len(made) == 1  # measured where asked only


def test_packs_fill_by_real_tokens_first_fit_decreasing():
    assert plan_micro_batches([30, 20, 10, 40], 60, packed=True) == [[1, 3], [0, 2]]
    assert plan_micro_batches([30, 20, 10, 40], 60) == [[3], [0, 1], [2]]  # padded: rows x the longest
    assert plan_micro_batches([7, 7], 16, length_multiple=4, packed=True) == [[0, 1]]  # 14 -> 16 with SP at TP4
    assert plan_micro_batches([7, 7, 3], 16, length_multiple=4, packed=True) == [[0, 1], [2]]  # 17 -> 20
    with pytest.raises(ValueError, match="sequence 1 has 70 tokens, more than max_tokens_per_micro_batch 64"):
        plan_micro_batches([10, 70], 64, packed=True)


def test_attention_takes_a_pack_in_buckets_of_similar_lengths():
    from megatron_dapo.policy.sdpa_attention import PackedSequences

    plan = PackedSequences.of([0, 3, 13, 24, 28, 40], "cpu")  # lengths 3, 10, 11, 4, 12
    assert [rows.shape for rows, _ in plan.buckets] == [(1, 3), (1, 4), (3, 12)]  # 4 > 1.25 x 3; 10, 11, 12
    rows, real = plan.buckets[2]
    assert rows[0].tolist() == list(range(3, 13)) + [12, 12]  # past its end, its last row again
    assert real.tolist() == list(range(10)) + list(range(12, 23)) + list(range(24, 36))
    gathered = torch.cat([r.reshape(-1)[k] for r, k in plan.buckets])
    assert gathered[plan.restore].tolist() == list(range(40))  # every row once, back in pack order
    assert plan.cu_seqlens_q.dtype == torch.int32 and plan.max_seqlen_q == 12


def test_a_pack_is_one_row_with_its_offsets_and_a_padding_tail():
    seqs = [Sequence(torch.arange(1, 6), 2), Sequence(torch.arange(10, 13), 1)]
    (mb,) = micro_batches(seqs, 64, length_multiple=4, packed=True)
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 5, 10, 11, 12]] and mb.cu_seqlens == [0, 5, 8]
    assert mb.targets.tolist() == [2, 3, 4, 5, 0, 11, 12, 0]  # no target across a boundary
    assert mb.response_positions.tolist() == [1, 2, 3, 5, 6]
    (tail,) = micro_batches(seqs[:1], 64, length_multiple=4, packed=True)
    assert tail.input_ids.shape == (1, 8) and tail.cu_seqlens == [0, 5, 8]  # the tail: a sequence of its own
    (filler,) = micro_batches([], 64, length_multiple=2, count=1, packed=True)
    assert filler.sample_index == [] and filler.cu_seqlens == [0, 2] and filler.num_response_tokens == 0


def test_packing_is_a_model_key_and_attention_refuses_packs_without_their_offsets(models):
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_dapo.policy.sdpa_attention import SdpaAttention

    with pytest.raises(ConfigError, match="model.packing: must be true or false, got 'yes'"):
        ModelConfig(path="m", packing="yes")
    model, *_ = models["qwen2"]
    attention = next(m for m in model.modules() if isinstance(m, SdpaAttention))
    q = torch.zeros(6, 4, 16)
    plain = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="packed_seq_params other than PackedSequences"):
        attention(q, q, q, None, packed_seq_params=plain)
