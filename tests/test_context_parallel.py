"""Context parallelism's layout (policy/context_parallel.py), in one process: every token goes to exactly one CP rank,
in megatron-core's load-balanced chunks, with what belongs to it (targets, routes, positions, which response token
it is). CP = 2 against CP = 1 through the model (log-probs, entropies, gradients): tests/test_policy_training.py;
with a mixture of experts replaying its routes: tests/test_routing_replay.py."""

from types import SimpleNamespace

import pytest
import torch

from megatron_dapo.policy.batch import Sequence, layout_multiples, micro_batches
from megatron_dapo.policy.context_parallel import AttentionPlan, kept_positions, split_micro_batch


def test_each_rank_keeps_chunks_r_and_2cp_minus_1_minus_r_of_every_sequence():
    assert kept_positions([(0, 8)], 2, 0).tolist() == [0, 1, 6, 7]
    assert kept_positions([(0, 8)], 2, 1).tolist() == [2, 3, 4, 5]
    assert kept_positions([(0, 8), (8, 12)], 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    every = torch.cat([kept_positions([(0, 24), (24, 36)], 3, r) for r in range(3)])
    assert sorted(every.tolist()) == list(range(36))


def test_a_sequence_that_does_not_cut_into_2cp_chunks_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="a sequence of 10 tokens does not cut into 2 x 4 chunks; pad it to a "
                                         "multiple of 8"):
        kept_positions([(0, 10)], 4, 0)


def test_the_layout_pads_for_context_and_sequence_parallelism():
    def config(cp, tp, sp):
        return SimpleNamespace(context_parallel_size=cp, tensor_model_parallel_size=tp, sequence_parallel=sp)

    assert layout_multiples(config(1, 2, True)) == (2, 1)
    assert layout_multiples(config(2, 1, False)) == (4, 4)
    assert layout_multiples(config(2, 2, True)) == (8, 4)  # megatron-core's 2 x CP x TP
    # packed: each sequence padded to 2 x CP, the pack to 2 x CP x TP
    (mb,) = micro_batches([Sequence(torch.arange(1, 8), 3), Sequence(torch.arange(1, 6), 2)], 100, 8, packed=True,
                          sequence_multiple=4)
    assert mb.cu_seqlens == [0, 8, 16] and mb.input_ids.shape == (1, 16)
    assert mb.targets[:8].tolist() == [2, 3, 4, 5, 6, 7, 0, 0]  # the padding after a sequence predicts nothing


def routed_sequences():
    g = torch.Generator().manual_seed(0)
    return [Sequence(torch.randint(1, 300, (p + r,), generator=g), p, torch.randint(0, 8, (p + r, 2, 2), generator=g))
            for p, r in ((5, 7), (3, 13), (9, 2))]


@pytest.mark.parametrize("packed", [False, True])
def test_the_ranks_shares_hold_every_token_once_with_its_target_route_position_and_response_index(packed):
    seqs = routed_sequences()
    (mb,) = micro_batches(seqs, 1000, 4, packed=packed, sequence_multiple=4)
    shares = [split_micro_batch(mb, 2, r) for r in range(2)]
    flat_ids, flat_routes = mb.input_ids.reshape(-1), mb.routes.reshape(-1, 2, 2)
    segments = list(zip(mb.cu_seqlens[:-1], mb.cu_seqlens[1:])) if packed else \
        [(r * mb.input_ids.shape[1], (r + 1) * mb.input_ids.shape[1]) for r in range(mb.input_ids.shape[0])]
    start_of = torch.cat([torch.full((b - a,), a) for a, b in segments])
    for rank, share in enumerate(shares):
        keep = kept_positions(segments, 2, rank)
        assert share.input_ids.shape == (mb.input_ids.shape[0], mb.input_ids.shape[1] // 2)
        assert torch.equal(share.input_ids.reshape(-1), flat_ids[keep])
        assert torch.equal(share.targets, mb.targets[keep])
        assert torch.equal(share.routes.reshape(-1, 2, 2), flat_routes[keep])
        assert torch.equal(share.position_ids.reshape(-1), keep - start_of[keep])  # its place in its sequence
        # each local response position is the global one the order names
        assert torch.equal(keep[share.response_positions], mb.response_positions[share.response_order])
        assert share.cu_seqlens == mb.cu_seqlens  # the whole pack's: the rotary embedding divides them
    order = torch.cat([s.response_order for s in shares])
    assert sorted(order.tolist()) == list(range(mb.num_response_tokens)) == list(range(22))


def test_a_rank_can_hold_no_response_token_of_a_sequence():
    """7 prompt and 3 response tokens, padded to 12: the positions predicting the response, 6 to 8, are all in rank
    1's chunks (3 to 8)."""
    (mb,) = micro_batches([Sequence(torch.arange(1, 11), 7)], 1000, 4, sequence_multiple=4)
    assert split_micro_batch(mb, 2, 0).num_response_tokens == 0
    assert split_micro_batch(mb, 2, 1).response_order.tolist() == [0, 1, 2]


def test_each_query_chunk_attends_its_sequence_up_to_itself():
    """Rank 1 of CP 2 holds chunks 1 and 2 of each sequence: chunk j sees its sequence's keys 0 .. (j + 1) c; the
    gathered keys (rank 0's then rank 1's) go back to global order."""
    plan = AttentionPlan.of([(0, 8), (8, 16)], 2, 1, "cpu")
    assert plan.chunks == ((0, 2, 0, 4), (2, 2, 0, 6), (4, 2, 8, 4), (6, 2, 8, 6))
    gathered = torch.cat([kept_positions([(0, 8), (8, 16)], 2, r) for r in range(2)])
    assert torch.equal(gathered[plan.global_rows], torch.arange(16))
