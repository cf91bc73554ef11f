"""RMSNorm for megatron-core's local layer spec that works with sequence parallelism.

The local spec's norm (megatron's WrappedTorchNorm, a torch.nn.RMSNorm) refuses sequence parallelism outright. The
norm itself needs nothing: it acts on each token alone. What sequence parallelism needs is that the weight's
gradient, computed on each tensor-parallel rank from its part of the sequence only, is summed over those ranks:
megatron-core's finalize_model_grads sums every parameter marked `sequence_parallel`. So this is torch's RMSNorm
with its weight marked, taking the constructor megatron-core calls norms with.
"""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.RMSNorm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        # The remaining keywords (persist_layer_norm, zero_centered_gamma, normalization) are the fused norms';
        # the transformer config turns their features off.
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel
