"""Per-token log-probs and entropy from vocabulary-parallel logits, without gathering the vocabulary.

The distribution is softmax(logits / temperature): the one the rollout engine samples from, so the
PPO ratio, the truncated-IS weights and the mismatch metrics all describe it. Each tensor-parallel
rank holds logits for its slice of the (padded) vocabulary. Per chunk of tokens the ranks
all-reduce the max, then (sum of exp, sum of exp * logit, target logit), each of the scaled logits
x / T: log Z, the target's log-prob and the entropy follow with no rank ever seeing the full
vocabulary. Padding columns beyond the true vocabulary are left out. Only one chunk is ever held in
fp32 (1/T is applied inside that chunk's arithmetic, never to a copy of the logits); the backward
recomputes the softmax chunk by chunk from the saved logits and log Z, d logp / dx =
(onehot(target) - softmax(x / T)) / T, optionally writing the gradient over the logits in place
(their producer, the output layer, does not need them back). Entropy is a metric: it carries no
gradient. At temperature 1 every multiplication by 1/T is by 1.0, and the result is log_softmax(x)'s up to the
order of its sums: in fp32 within an ulp or two of torch.log_softmax (equal in about 3 tokens of 4 at a vocabulary
of 320; bench/bench_engine_parity.py), the one op where the trainer's log-probs part from transformers'.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

CHUNK_ELEMENTS = 1 << 25  # fp32 elements of one chunk (128 MiB)


def _chunks(n_tokens: int, n_cols: int):
    rows = max(1, CHUNK_ELEMENTS // max(1, n_cols))
    for start in range(0, n_tokens, rows):
        yield start, min(n_tokens, start + rows)


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, valid_cols, group, inplace_backward, inv_temperature):
        n = logits.shape[0]
        inv_t = inv_temperature
        compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
        logp = torch.empty(n, dtype=compute, device=logits.device)
        entropy = torch.empty_like(logp)
        log_z = torch.empty_like(logp)
        local_target = targets - vocab_start
        owned = (local_target >= 0) & (local_target < valid_cols)
        safe_target = torch.where(owned, local_target, 0)
        for a, b in _chunks(n, valid_cols):
            x = logits[a:b, :valid_cols].to(compute)
            x_max = x.max(dim=1).values if valid_cols > 0 else x.new_full((b - a,), -float("inf"))
            _all_reduce(x_max, dist.ReduceOp.MAX, group)
            # max(x / T) = max(x) / T for T > 0; e = exp((x - max x) / T), built in place in one chunk.
            e = torch.sub(x, x_max[:, None]).mul_(inv_t).exp_()
            target = x.gather(1, safe_target[a:b, None]).squeeze(1) if valid_cols > 0 else x_max.new_zeros(b - a)
            sums = torch.stack([e.sum(dim=1), (e * x).sum(dim=1) * inv_t, torch.where(owned[a:b], target * inv_t, 0.0)])
            del e
            _all_reduce(sums, dist.ReduceOp.SUM, group)
            log_z[a:b] = x_max * inv_t + torch.log(sums[0])
            logp[a:b] = sums[2] - log_z[a:b]
            entropy[a:b] = log_z[a:b] - sums[1] / sums[0]
        ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(logits, safe_target, owned, log_z)
        ctx.valid_cols = valid_cols
        ctx.inplace_backward = inplace_backward
        ctx.inv_t = inv_t
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, safe_target, owned, log_z = ctx.saved_tensors
        valid, inv_t = ctx.valid_cols, ctx.inv_t
        grad = logits if ctx.inplace_backward else torch.empty_like(logits)
        grad[:, valid:] = 0
        if grad_logp is None or valid == 0:
            grad.zero_()
            return grad, None, None, None, None, None, None
        scaled = grad_logp * inv_t  # the chain rule's 1/T, per row
        for a, b in _chunks(logits.shape[0], valid):
            # d logp / d x = (onehot(target) - softmax(x / T)) / T
            chunk = torch.mul(logits[a:b, :valid].to(log_z.dtype), inv_t).sub_(log_z[a:b, None]).exp_()
            chunk.mul_(-scaled[a:b, None])
            rows = torch.arange(b - a, device=chunk.device)
            chunk[rows, safe_target[a:b]] += torch.where(owned[a:b], scaled[a:b], 0.0)
            grad[a:b, :valid] = chunk
        return grad, None, None, None, None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, vocab_start: int, vocab_size: int,
                            group=None, inplace_backward: bool = False,
                            temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and the entropy of p = softmax(logits / temperature) at each of `logits`' rows, both [n] in
    fp32 (fp64 for fp64 logits).

    `logits` [n, V_local] holds vocabulary columns [vocab_start, vocab_start + V_local) of this rank;
    `vocab_size` is the true vocabulary (columns at or beyond it are padding); `group` the tensor-
    parallel group (None: one rank holds everything). With `inplace_backward` the gradient overwrites
    `logits`: only for logits that nothing else reads afterwards. `temperature`: the sampling temperature
    (rollout.temperature), > 0.
    """
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [tokens, vocab_local] and targets [tokens], got {tuple(logits.shape)} "
                         f"and {tuple(targets.shape)}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature: must be a finite number > 0, got {temperature!r}")
    valid_cols = max(0, min(logits.shape[1], vocab_size - vocab_start))
    return _VocabParallelLogProbs.apply(logits, targets, vocab_start, valid_cols, group, inplace_backward,
                                        1.0 / float(temperature))
