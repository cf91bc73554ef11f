"""This rank's share of a kept rollout batch -> training samples, with the old policy's log-probs.

The old policy's log-probs (the current weights, before the step's first update) are recomputed for
the whole share in one forward-only pass and handed from the last pipeline stage to every stage;
like the reference policy's, they are those of softmax(logits / rollout.temperature), the
distribution the engine sampled from and whose log-probs it returned.
Everything per token is built once for the share, on the rank's device, and cut into per-response
views: the engine's log-probs travel to the device in one copy. With loss.correction each token gets its
weight (ops/rollout_correction.py) here, where whole responses are, before any split into micro-batches or
context-parallel shares: a response's ratio needs all its tokens.
With loss.old_logprobs "rollout" (the in-process engine in sync mode, which sampled with these very
weights) the engine's log-probs are pi_old's and nothing is recomputed: no entropies, no mismatch.
With routing replay the recompute also counts the routing agreement (policy/routing_agreement.py).
"""

from __future__ import annotations

import torch

from megatron_dapo.parallel.rank_shares import PackedShare
from megatron_dapo.policy.batch import Sequence
from megatron_dapo.policy.forward import response_logprobs, to_every_stage
from megatron_dapo.ops.rollout_correction import correction_weights
from megatron_dapo.policy.mismatch import empty_sums, mismatch_sums
from megatron_dapo.policy.routing_agreement import RoutingAgreement
from megatron_dapo.policy.train_step import RolloutSample


def _flat_logprobs(model, seqs: list[Sequence], numel: int, device: torch.device, **kwargs):
    """Response-token (log-probs, entropies) of every sequence, concatenated; log-probs on every stage,
    entropies on the last stage only (None elsewhere)."""
    out = response_logprobs(model, seqs, device=device, **kwargs)
    if out is None:
        return to_every_stage(None, numel, device), None
    return to_every_stage(torch.cat([o[0] for o in out]), numel, device), torch.cat([o[1] for o in out])


def training_samples(model, reference, share: PackedShare, *, spec, max_tokens_per_micro_batch: int,
                     device: torch.device, correction: dict | None = None, temperature: float = 1.0,
                     old_logprobs: str = "recompute", packed: bool = False
                     ) -> tuple[list[RolloutSample], torch.Tensor, torch.Tensor, list[float] | None]:
    """RolloutSamples for `share` (this rank's responses), on `device`; this rank's mismatch sums and maxima
    (policy/mismatch.py) over its loss tokens (zeros on all but one
    rank per data-parallel replica, so that world-wide sums count every response once; with `old_logprobs`
    "rollout" only the loss tokens and the KL reference's sum are not zeros); and with routing replay and a
    recompute, the routing agreement per MoE layer over all ranks (collective), else None. `correction`:
    loss.correction's rule (CorrectionConfig.rule()), None for none. `temperature`:
    rollout.temperature, at which the old (and reference) log-probs and entropies are computed. `old_logprobs`:
    loss.old_logprobs. `packed`: model.packing."""
    from megatron.core import parallel_state

    seqs = [Sequence(tokens.long(), prompt_len, None if routes is None else torch.from_numpy(routes))
            for tokens, prompt_len, routes in zip(share.sequences(), share.prompt_lens.tolist(),
                                                  share.response_routes())]
    lengths = share.output_lens.tolist()
    numel = sum(lengths)
    kwargs = dict(vocab_size=spec.vocab_size, max_positions=spec.max_position_embeddings,
                  max_tokens_per_micro_batch=max_tokens_per_micro_batch, temperature=temperature, packed=packed)
    rollout = share.rollout_logp.to(device)
    agreement = None
    if old_logprobs == "rollout":
        old, entropy = rollout, None
    else:
        agreement = RoutingAgreement(model) if getattr(model.config, "moe_enable_routing_replay", False) else None
        old, entropy = _flat_logprobs(model, seqs, numel, device, agreement=agreement, **kwargs)
    ref = _flat_logprobs(reference, seqs, numel, device, **kwargs)[0] if reference is not None else None

    per_token = share.output_lens.to(device)
    advantages = share.advantages.to(device, torch.float32)
    in_loss = share.in_loss.to(device).repeat_interleave(per_token)
    log_ratio = old.double() - rollout  # log pi_old / pi_rollout
    none = [None] * len(share)
    weights = correction_weights(log_ratio, per_token, in_loss, **correction) if correction is not None else None
    samples = [RolloutSample(seq, lp, adv, mask, r, w)
               for seq, lp, adv, mask, r, w in zip(
                   seqs, old.float().split(lengths), advantages.repeat_interleave(per_token).split(lengths),
                   in_loss.split(lengths), ref.float().split(lengths) if ref is not None else none,
                   weights.float().split(lengths) if weights is not None else none)]

    reporter = parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0 \
        and parallel_state.get_context_parallel_rank() == 0
    if reporter and (entropy is not None or ref is not None):
        # With the engine's log-probs as pi_old nothing is recomputed (no entropy; a mismatch of 0), but the KL
        # reference's distance is still there to sum.
        sums, maxima = mismatch_sums(log_ratio, per_token, entropy, in_loss, weights,
                                     ref.double() - old.double() if ref is not None else None)
    else:
        sums, maxima = empty_sums(device)
    return samples, sums, maxima, agreement.shares() if agreement is not None else None
