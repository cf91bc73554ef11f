"""From a kept rollout batch to this rank's training samples, with the old policy's log-probs.

The batch is the same on every rank. Responses are dealt round-robin to the data-parallel ranks,
and each rank's share is cut into the step's mini-batches (one optimizer step each). The old
policy's log-probs (the current weights, before the step's first update) are recomputed for the
whole share in one forward-only pass and handed from the last pipeline stage to every stage.
Rollout-vs-trainer mismatch is measured on the same tokens, and, when loss.tis_cap is set, each
token is weighted by min(pi_old / pi_rollout, cap) (truncated importance sampling).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_dapo.algorithm.rollout_batch import RolloutBatch
from megatron_dapo.policy.batch import Sequence
from megatron_dapo.policy.forward import response_logprobs
from megatron_dapo.policy.train_step import RolloutSample

# Sums over this rank's loss tokens, summed over the world for the step's metrics.
MISMATCH_KEYS = ("tokens", "entropy_sum", "mismatch_k3_sum", "mismatch_abs_sum", "tis_weight_sum", "tis_capped")


@dataclass(frozen=True)
class TrainItem:
    """One response of the kept batch, as the trainer needs it."""

    prompt_ids: list[int]
    output_ids: list[int]
    rollout_logp: list[float]  # the inference engine's log-prob of each output token
    advantage: float
    in_loss: bool  # False: left out of the loss (overlong filtering)


def flatten(batch: RolloutBatch) -> list[TrainItem]:
    """The batch's responses, groups in prompt order: the order groups completed in does not matter."""
    groups = sorted(batch.groups, key=lambda g: g.prompt.index)
    return [TrainItem(g.prompt.token_ids, list(s.output_ids), list(s.logprobs), float(g.advantages[i]),
                      bool(g.loss_mask[i]))
            for g in groups for i, s in enumerate(g.samples)]


def data_parallel_share(items: list[TrainItem], dp_rank: int, dp_size: int) -> list[TrainItem]:
    if len(items) % dp_size:
        raise ValueError(f"{len(items)} responses do not divide across {dp_size} data-parallel ranks")
    return items[dp_rank::dp_size]


def split_even(samples: list, count: int) -> list[list]:
    """`samples` cut into min(count, len) contiguous parts whose sizes differ by at most one."""
    count = min(count, len(samples))
    bounds = [round(i * len(samples) / count) for i in range(count + 1)]
    return [samples[bounds[i]:bounds[i + 1]] for i in range(count)]


def _to_every_stage(values: list[torch.Tensor] | None, lengths: list[int]) -> list[torch.Tensor]:
    """Per-response tensors computed on the last pipeline stage, copied to every stage of this pipeline."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return values
    flat = torch.cat(values).float() if values is not None else torch.empty(sum(lengths))
    dist.broadcast(flat, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                   group=parallel_state.get_pipeline_model_parallel_group())
    return list(flat.split(lengths))


def training_samples(model, reference, items: list[TrainItem], *, spec, max_tokens: int, device: torch.device,
                     tis_cap: float | None) -> tuple[list[RolloutSample], torch.Tensor, torch.Tensor]:
    """RolloutSamples for `items` (this rank's share), this rank's mismatch sums (MISMATCH_KEYS) and the
    largest |log pi_old - log pi_rollout| of its loss tokens."""
    from megatron.core import parallel_state

    seqs = [Sequence(torch.tensor(it.prompt_ids + it.output_ids, dtype=torch.long), len(it.prompt_ids))
            for it in items]
    lengths = [len(it.output_ids) for it in items]
    kwargs = dict(vocab_size=spec.vocab_size, max_positions=spec.max_position_embeddings,
                  max_tokens_per_micro_batch=max_tokens, device=device)
    out = response_logprobs(model, seqs, **kwargs)
    old = _to_every_stage([o[0] for o in out] if out is not None else None, lengths)
    entropy = [o[1] for o in out] if out is not None else None
    ref = None
    if reference is not None:
        ref_out = response_logprobs(reference, seqs, **kwargs)
        ref = _to_every_stage([o[0] for o in ref_out] if ref_out is not None else None, lengths)

    sums = torch.zeros(len(MISMATCH_KEYS), dtype=torch.float64)
    abs_max = torch.zeros(1, dtype=torch.float64)
    samples = []
    for i, (it, seq) in enumerate(zip(items, seqs)):
        n = len(it.output_ids)
        log_ratio = old[i].double() - torch.tensor(it.rollout_logp, dtype=torch.float64)  # log pi_old / pi_rollout
        weight = torch.exp(log_ratio).clamp(max=tis_cap) if tis_cap is not None else None
        in_loss = torch.full((n,), it.in_loss)
        loss_mask = in_loss if weight is None else torch.where(in_loss, weight, 0.0).float()
        samples.append(RolloutSample(seq, old[i].float(), torch.full((n,), it.advantage), loss_mask,
                                     ref[i].float() if ref is not None else None))
        if entropy is not None and it.in_loss:
            k3 = torch.exp(-log_ratio) + log_ratio - 1  # KL(rollout || old), estimated on the rollout's samples
            capped = (torch.exp(log_ratio) > tis_cap).sum() if tis_cap is not None else 0
            sums += torch.tensor([n, entropy[i].double().sum(), k3.sum(), log_ratio.abs().sum(),
                                  weight.sum() if weight is not None else 0.0, capped], dtype=torch.float64)
            abs_max = torch.maximum(abs_max, log_ratio.abs().max().reshape(1))
    # One rank per data-parallel replica reports, so world-wide reductions count every response once.
    if not (parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0):
        sums.zero_()
        abs_max.zero_()
    return samples, sums, abs_max
