"""Run the policy over micro-batches through megatron-core's pipeline schedules.

`response_logprobs` gives, for every response token, its log-prob under the policy and the entropy
of the policy at that position. Forward-only: no gradient, no saved activations. The results live
on the last pipeline stage (where the loss is computed); other stages get None.
"""

from __future__ import annotations

from functools import partial

import torch

from megatron_dapo.policy.batch import MicroBatch, Sequence, check_sequences, micro_batches
from megatron_dapo.policy.logprobs import vocab_parallel_logprobs


def tp_vocab_slice(logits_cols: int) -> tuple[int, object]:
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    return parallel_state.get_tensor_model_parallel_rank() * logits_cols, group


def micro_batch_logprobs(logits: torch.Tensor, mb: MicroBatch, vocab_size: int, *, inplace_backward: bool):
    """Response-token log-probs and entropy of one micro-batch from the model's [rows, length, V/TP] logits."""
    flat = logits.reshape(-1, logits.shape[-1])
    vocab_start, group = tp_vocab_slice(flat.shape[-1])
    logp, entropy = vocab_parallel_logprobs(flat, mb.targets.to(flat.device), vocab_start=vocab_start,
                                            vocab_size=vocab_size, group=group, inplace_backward=inplace_backward)
    pos = mb.response_positions.to(flat.device)
    return logp[pos], entropy[pos]


def model_forward(model, mb: MicroBatch, device: torch.device):
    ids = mb.input_ids.to(device)
    position_ids = torch.arange(ids.shape[1], device=device).expand_as(ids)
    return model(ids, position_ids, None)


def is_last_stage() -> bool:
    from megatron.core import parallel_state

    return parallel_state.is_pipeline_last_stage()


@torch.no_grad()
def response_logprobs(model, sequences: list[Sequence], *, vocab_size: int, max_positions: int,
                      max_tokens_per_micro_batch: int, device: torch.device):
    """Per sequence: (log-probs, entropies) of its response tokens, fp32, on the last stage; else None."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    check_sequences(sequences, max_positions)
    mbs = micro_batches(sequences, max_tokens_per_micro_batch)

    def loss_func(mb, logits):
        logp, entropy = micro_batch_logprobs(logits, mb, vocab_size, inplace_backward=False)
        return logits.new_zeros(()), {"logp": logp, "entropy": entropy}

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        return model_forward(model, mb, device), partial(loss_func, mb)

    outputs = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(mbs), model=[model], num_microbatches=len(mbs),
        seq_length=max(mb.input_ids.shape[1] for mb in mbs), micro_batch_size=1, forward_only=True,
    )
    if not is_last_stage():
        return None
    result: list = [None] * len(sequences)
    for mb, out in zip(mbs, outputs):
        logps, ents = out["logp"].split(mb.response_lens), out["entropy"].split(mb.response_lens)
        for i, lp, en in zip(mb.sample_index, logps, ents):
            result[i] = (lp, en)
    return result
