"""Per-token log-probs and entropy from vocabulary-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds logits for its slice of the (padded) vocabulary. Per chunk of tokens
the ranks all-reduce the max, then (sum of exp, sum of exp * logit, target logit): log Z, the
target's log-prob and the entropy follow with no rank ever seeing the full vocabulary. Padding
columns beyond the true vocabulary are left out. Only one chunk is ever held in fp32; the backward
recomputes the softmax chunk by chunk from the saved logits and log Z, optionally writing the
gradient over the logits in place (their producer, the output layer, does not need them back).
Entropy is a metric: it carries no gradient.
"""

from __future__ import annotations

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
    def forward(ctx, logits, targets, vocab_start, valid_cols, group, inplace_backward):
        n = logits.shape[0]
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
            e = torch.exp(x - x_max[:, None])
            target = x.gather(1, safe_target[a:b, None]).squeeze(1) if valid_cols > 0 else x_max.new_zeros(b - a)
            sums = torch.stack([e.sum(dim=1), (e * x).sum(dim=1), torch.where(owned[a:b], target, 0.0)])
            del e
            _all_reduce(sums, dist.ReduceOp.SUM, group)
            log_z[a:b] = x_max + torch.log(sums[0])
            logp[a:b] = sums[2] - log_z[a:b]
            entropy[a:b] = log_z[a:b] - sums[1] / sums[0]
        ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(logits, safe_target, owned, log_z)
        ctx.valid_cols = valid_cols
        ctx.inplace_backward = inplace_backward
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, safe_target, owned, log_z = ctx.saved_tensors
        valid = ctx.valid_cols
        grad = logits if ctx.inplace_backward else torch.empty_like(logits)
        grad[:, valid:] = 0
        if grad_logp is None or valid == 0:
            grad.zero_()
            return grad, None, None, None, None, None
        for a, b in _chunks(logits.shape[0], valid):
            g = grad_logp[a:b, None]
            # d logp / d x = onehot(target) - softmax(x)
            chunk = torch.exp(logits[a:b, :valid].to(log_z.dtype) - log_z[a:b, None]).mul_(-g)
            rows = torch.arange(b - a, device=chunk.device)
            chunk[rows, safe_target[a:b]] += torch.where(owned[a:b], grad_logp[a:b], 0.0)
            grad[a:b, :valid] = chunk
        return grad, None, None, None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, vocab_start: int, vocab_size: int,
                            group=None, inplace_backward: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and the entropy at each of `logits`' rows, both [n] in fp32 (fp64 for fp64 logits).

    `logits` [n, V_local] holds vocabulary columns [vocab_start, vocab_start + V_local) of this rank;
    `vocab_size` is the true vocabulary (columns at or beyond it are padding); `group` the tensor-
    parallel group (None: one rank holds everything). With `inplace_backward` the gradient overwrites
    `logits`: only for logits that nothing else reads afterwards.
    """
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [tokens, vocab_local] and targets [tokens], got {tuple(logits.shape)} "
                         f"and {tuple(targets.shape)}")
    valid_cols = max(0, min(logits.shape[1], vocab_size - vocab_start))
    return _VocabParallelLogProbs.apply(logits, targets, vocab_start, valid_cols, group, inplace_backward)
