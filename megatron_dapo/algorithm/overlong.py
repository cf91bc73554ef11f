"""Length: DAPO's soft overlong punishment (the paper's Eq. 13) and overlong filtering.

A response longer than it should be is penalised gradually: nothing up to L_max - L_cache tokens, a
penalty growing linearly to -1 across the last L_cache tokens, and -1 beyond L_max. The penalty is
added to the correctness reward. Overlong filtering instead takes truncated responses (cut off at
the generation limit, so their final answer was never written) out of the loss altogether.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_dapo.algorithm.config import check_overlong_lengths

TRUNCATED = "length"  # the engine's finish_reason for a response cut off at max_new_tokens


def overlong_penalty(lengths: Sequence[int] | torch.Tensor, max_response_len: int, cache_len: int) -> torch.Tensor:
    """Eq. 13 for each response length |y|, as float64:

        0                                    if |y| <= L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
        -1                                   if |y| > L_max
    """
    check_overlong_lengths(max_response_len, cache_len)
    y = torch.as_tensor(lengths, dtype=torch.float64)
    if y.dim() != 1:
        raise ValueError(f"overlong_penalty: lengths must be 1-D (one per response), got shape {tuple(y.shape)}")
    if (y < 0).any():
        raise ValueError(f"overlong_penalty: response lengths must be >= 0, got {y.min().item():g}")
    expected = max_response_len - cache_len
    # With L_cache = 0 the linear interval is empty and never selected; max() only avoids dividing by zero.
    linear = (expected - y) / max(cache_len, 1)
    penalty = torch.where(y <= expected, torch.zeros_like(y), linear)
    return torch.where(y > max_response_len, torch.full_like(y, -1.0), penalty)


def overlong_loss_mask(finish_reasons: Sequence[str], filter_truncated: bool) -> torch.Tensor:
    """Per response: True if it takes part in the loss; with filtering, truncated responses do not."""
    truncated = torch.tensor([reason == TRUNCATED for reason in finish_reasons], dtype=torch.bool)
    return ~truncated if filter_truncated else torch.ones_like(truncated)
