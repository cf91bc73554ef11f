"""Run the policy over micro-batches through megatron-core's pipeline schedules.

`response_logprobs` gives, for every response token, its log-prob under the policy and the entropy
of the policy at that position, both of the distribution softmax(logits / temperature) that the
rollout samples from (rollout.temperature). Forward-only: no gradient, no saved activations. The
results live on the last pipeline stage (where the loss is computed); other stages get None.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist

from megatron_dapo.policy.batch import (
    MicroBatch,
    Sequence,
    check_sequences,
    layout_multiples,
    micro_batches,
    plan_micro_batches,
)
from megatron_dapo.policy.context_parallel import gather_responses, split_micro_batch
from megatron_dapo.policy.logprobs import vocab_parallel_logprobs
from megatron_dapo.policy.output_positions import logits_at


def tp_vocab_slice(logits_cols: int) -> tuple[int, object]:
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    return parallel_state.get_tensor_model_parallel_rank() * logits_cols, group


def micro_batch_logprobs(logits: torch.Tensor, mb: MicroBatch, vocab_size: int, *, inplace_backward: bool,
                         temperature: float = 1.0):
    """Response-token log-probs and entropy of softmax(logits / temperature) for one micro-batch, from the model's
    logits at its response positions (model_forward: [1, rows computed, V/TP], the first the positions')."""
    n = mb.num_response_tokens
    flat = logits.reshape(-1, logits.shape[-1])[:n]
    vocab_start, group = tp_vocab_slice(flat.shape[-1])
    targets = mb.targets[mb.response_positions].to(flat.device)
    return vocab_parallel_logprobs(flat, targets, vocab_start=vocab_start, vocab_size=vocab_size, group=group,
                                   inplace_backward=inplace_backward, temperature=temperature)


def model_micro_batches(config, sequences: list[Sequence], max_tokens: int, device: torch.device,
                        packed: bool = False) -> list[MicroBatch]:
    """This rank's sequences in micro-batches (packed or padded, policy/batch.py) for a model of megatron-core
    TransformerConfig `config`: as long as sequence and context parallelism need, with context parallelism this
    CP rank's share of each (policy/context_parallel.py; `max_tokens` counts the whole micro-batch, before the cut),
    and with expert parallelism as many on every data-parallel rank as the rank of most (collective over the
    data-parallel group then)."""
    from megatron.core import parallel_state

    multiple, per_sequence = layout_multiples(config)
    count = None
    if config.expert_model_parallel_size > 1:
        mine = len(plan_micro_batches([s.tokens.numel() for s in sequences], max_tokens, multiple, packed=packed,
                                      sequence_multiple=per_sequence))
        agreed = torch.tensor([mine], device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=parallel_state.get_data_parallel_group())
        count = int(agreed.item())
    mbs = micro_batches(sequences, max_tokens, multiple, count, packed, per_sequence)
    cp, rank = config.context_parallel_size, parallel_state.get_context_parallel_rank()
    return [split_micro_batch(mb, cp, rank) for mb in mbs]


def route_replayer(model):
    """A RouteReplayer for a model built with routing replay, emptied for a new pass; None for the others."""
    from megatron_dapo.policy.routing_replay import RouteReplayer

    config = model.config
    if not getattr(config, "moe_enable_routing_replay", False):
        return None
    replayer = RouteReplayer(model)
    replayer.begin()
    return replayer


def model_forward(model, mb: MicroBatch, device: torch.device):
    """The model's logits at `mb`'s response positions only (policy/output_positions.py); on the last stage
    [1, rows computed, V/TP], elsewhere the stage's hidden states."""
    ids = mb.input_ids.to(device)
    with logits_at(model, mb.response_positions.to(device)):
        if mb.cu_seqlens is None:
            position_ids = mb.position_ids.to(device) if mb.position_ids is not None else \
                torch.arange(ids.shape[1], device=device).expand_as(ids)
            return model(ids, position_ids, None)
        from megatron_dapo.policy.sdpa_attention import PackedSequences

        # Positions restart with each sequence (the rotary embedding takes them from cu_seqlens).
        cu = mb.cu_seqlens
        position_ids = mb.position_ids.to(device) if mb.position_ids is not None else \
            torch.cat([torch.arange(b - a, device=device) for a, b in zip(cu[:-1], cu[1:])])[None]
        return model(ids, position_ids, None, packed_seq_params=PackedSequences.of(cu, device))


def is_last_stage() -> bool:
    from megatron.core import parallel_state

    return parallel_state.is_pipeline_last_stage()


@torch.no_grad()
def response_logprobs(model, sequences: list[Sequence], *, vocab_size: int, max_positions: int,
                      max_tokens_per_micro_batch: int, device: torch.device, temperature: float = 1.0,
                      packed: bool = False, agreement=None):
    """Per sequence: (log-probs, entropies) of its response tokens under softmax(logits / temperature), fp32, on
    the last stage; else None. `packed`: model.packing (policy/batch.py). `agreement`: a RoutingAgreement of the
    model's routers (policy/routing_agreement.py) that counts this pass, with routing replay."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    check_sequences(sequences, max_positions)
    replayer = route_replayer(model)
    if replayer is not None:
        replayer.check(sequences)
    mbs = model_micro_batches(model.config, sequences, max_tokens_per_micro_batch, device, packed)

    def loss_func(mb, logits):
        logp, entropy = micro_batch_logprobs(logits, mb, vocab_size, inplace_backward=False, temperature=temperature)
        return logits.new_zeros(()), {"logp": logp, "entropy": entropy}

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        if replayer is None:
            return model_forward(model, mb, device), partial(loss_func, mb)
        if agreement is not None:
            agreement.micro_batch(mb)
        return replayer.before_forward(mb, recompute=False)(model_forward(model, mb, device)), partial(loss_func, mb)

    try:
        with agreement if agreement is not None and replayer is not None else nullcontext():
            outputs = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(mbs), model=[model], num_microbatches=len(mbs),
                seq_length=max(mb.input_ids.shape[1] for mb in mbs), micro_batch_size=1, forward_only=True,
            )
    finally:
        if replayer is not None:
            replayer.end()
    if not is_last_stage():
        return None
    result: list = [None] * len(sequences)
    outputs = gather_responses(mbs, [torch.stack([out["logp"], out["entropy"]]) for out in outputs])
    for mb, out in zip(mbs, outputs):
        if not mb.sample_index:  # a filler
            continue
        logps, ents = out[0].split(mb.response_lens), out[1].split(mb.response_lens)
        for i, lp, en in zip(mb.sample_index, logps, ents):
            result[i] = (lp, en)
    return result


def to_every_stage(values: torch.Tensor | None, numel: int, device: torch.device) -> torch.Tensor:
    """A flat fp32 tensor computed on the last pipeline stage (None elsewhere), on every stage of this pipeline."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return values
    flat = values.float() if values is not None else torch.empty(numel, device=device)
    dist.broadcast(flat, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                   group=parallel_state.get_pipeline_model_parallel_group())
    return flat


def logprob_recomputer(model, *, vocab_size: int, max_positions: int, max_tokens_per_micro_batch: int,
                       device: torch.device, packed: bool = False):
    """`recompute(responses, temperature)`: for (prompt_ids, output_ids, routes) triples, each response's token
    log-probs under softmax(logits / temperature) as a list of floats, on every pipeline stage; `routes` (the
    engine's, [positions, MoE layers, top_k], or None) are replayed by a model built with routing replay.
    Collective: every rank of the model calls it with the same responses. The model runs in eval mode and is left in
    its own mode."""

    def recompute(responses: list[tuple[list[int], list[int], object]], temperature: float) -> list[list[float]]:
        seqs = [Sequence(torch.tensor(list(p) + list(o), dtype=torch.long), len(p),
                         None if r is None else torch.as_tensor(r)) for p, o, r in responses]
        lengths = [len(o) for _, o, _ in responses]
        was_training = model.training
        model.eval()
        try:
            out = response_logprobs(model, seqs, vocab_size=vocab_size, max_positions=max_positions,
                                    max_tokens_per_micro_batch=max_tokens_per_micro_batch, device=device,
                                    temperature=temperature, packed=packed)
        finally:
            model.train(was_training)
        flat = to_every_stage(torch.cat([o[0] for o in out]) if out is not None else None, sum(lengths), device)
        return [t.tolist() for t in flat.double().cpu().split(lengths)]

    return recompute
