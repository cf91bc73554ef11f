"""How far the inference engine's probabilities are from the trainer's, and what the rollout correction did.

Per loss token, r = log pi_old - log pi_rollout (the trainer's recomputation against the engine's log-prob of the
sampled token). The metrics are sums over a rank's loss tokens and responses, kept on the rank's device and summed
(maxima: maxed) over the world once per step; step_metrics turns them into means and shares. Ratios are those
before the correction, their exponents clamped as the correction clamps them (ops/rollout_correction.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_dapo.ops.rollout_correction import LOG_WEIGHT_CLAMP

MISMATCH_KEYS = (
    "tokens", "entropy_sum", "mismatch_k3_sum", "mismatch_abs_sum", "reference_k3_sum",
    "token_ratio_sum", "token_ratio_sq_sum",  # exp(r) and its square (chi-square: E_rollout[ratio^2] - 1)
    "sequences", "seq_ratio_sum", "seq_log_ratio_sum", "seq_log_ratio_sq_sum",  # responses with a loss token
    "weight_sum", "masked_tokens", "masked_sequences",  # the correction's weights, where there is one
)
MAX_KEYS = ("abs_max", "token_ratio_max", "seq_ratio_max")


def mismatch_sums(log_ratio: torch.Tensor, lengths: torch.Tensor, entropy: torch.Tensor | None,
                  in_loss: torch.Tensor, weights: torch.Tensor | None = None,
                  reference_log_ratio: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's sums (MISMATCH_KEYS, float64) and maxima (MAX_KEYS) over the tokens where `in_loss`, and the
    responses with one; every per-token input is one entry per token of the responses laid end to end (`lengths`
    each), on the same device, and so are the results. `weights`: the correction's, None without one.
    `reference_log_ratio`: log pi_ref - log pi_old where the loss has a KL term (its k3 estimate of KL(old ||
    reference) is summed; 0 without one). `entropy` None: nothing was recomputed (its sum is 0)."""
    r = log_ratio[in_loss].double()
    zero = r.new_zeros(())
    ratio = torch.exp(r.clamp(-LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP))
    seq_log = torch.segment_reduce(torch.where(in_loss, log_ratio.double(), 0.0), "sum", lengths=lengths)
    loss_tokens = torch.segment_reduce(in_loss.double(), "sum", lengths=lengths)
    has_loss = loss_tokens > 0
    seq_log = seq_log[has_loss]
    seq_ratio = torch.exp(seq_log.clamp(-LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP))
    if weights is not None:
        w = weights.double()
        kept = torch.segment_reduce(torch.where(in_loss & (w != 0), 1.0, 0.0).double(), "sum", lengths=lengths)
        corrected = [w[in_loss].sum(), (w[in_loss] == 0).sum().double(), (has_loss & (kept == 0)).sum().double()]
    else:
        corrected = [zero, zero, zero]
    sums = torch.stack([
        in_loss.sum().double(), entropy[in_loss].double().sum() if entropy is not None else zero, _k3(r).sum(),
        r.abs().sum(), _k3(reference_log_ratio[in_loss].double()).sum() if reference_log_ratio is not None else zero,
        ratio.sum(), ratio.square().sum(),
        has_loss.sum().double(), seq_ratio.sum(), seq_log.sum(), seq_log.square().sum(),
        *corrected])
    maxima = torch.stack([_max(r.abs()), _max(ratio), _max(seq_ratio)])
    return sums, maxima


def _max(x: torch.Tensor) -> torch.Tensor:
    return x.max() if x.numel() else x.new_zeros(())


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimate of KL(p || q) per token sampled from p, given log q - log p: >= 0, unbiased."""
    return torch.exp(log_ratio) - log_ratio - 1


def empty_sums(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """What a rank that does not report adds: nothing."""
    return (torch.zeros(len(MISMATCH_KEYS), dtype=torch.float64, device=device),
            torch.zeros(len(MAX_KEYS), dtype=torch.float64, device=device))


def reduce_mismatch(sums: torch.Tensor, maxima: torch.Tensor) -> dict[str, float]:
    """Collective over all ranks: the world's sums and maxima by name (MISMATCH_KEYS, MAX_KEYS). Each data-parallel
    replica must contribute once: the other ranks pass empty_sums."""
    dist.all_reduce(sums)
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    return {**dict(zip(MISMATCH_KEYS, sums.tolist())), **dict(zip(MAX_KEYS, maxima.tolist()))}


def mismatch_metrics(m: dict[str, float], corrected: bool) -> dict[str, float]:
    """The metrics of reduce_mismatch's sums: engine vs trainer before the correction; with one (`corrected`),
    what it weighed and masked."""
    tokens, sequences = max(m["tokens"], 1.0), max(m["sequences"], 1.0)
    seq_log_mean = m["seq_log_ratio_sum"] / sequences
    out = {
        "mismatch/kl": m["mismatch_k3_sum"] / tokens,  # k3 estimate of KL(rollout || old)
        "mismatch/chi2": m["token_ratio_sq_sum"] / tokens - 1.0,  # chi-square(old || rollout), per token
        "mismatch/abs_mean": m["mismatch_abs_sum"] / tokens, "mismatch/abs_max": m["abs_max"],
        "mismatch/token_ratio_mean": m["token_ratio_sum"] / tokens, "mismatch/token_ratio_max": m["token_ratio_max"],
        "mismatch/seq_ratio_mean": m["seq_ratio_sum"] / sequences, "mismatch/seq_ratio_max": m["seq_ratio_max"],
        # the spread over responses of their summed log-ratio (what exp(sum) weights are exp of)
        "mismatch/seq_log_ratio_std": max(m["seq_log_ratio_sq_sum"] / sequences - seq_log_mean ** 2, 0.0) ** 0.5,
    }
    if corrected:
        out.update({"correction/weight_mean": m["weight_sum"] / tokens,
                    "correction/masked_token_frac": m["masked_tokens"] / tokens,
                    "correction/masked_seq_frac": m["masked_sequences"] / sequences})
    return out
