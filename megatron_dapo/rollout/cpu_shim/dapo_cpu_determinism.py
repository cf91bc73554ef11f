"""SGLang plugin, found through its entry point when cpu_shim/ is on the path (CPU servers only): --enable-deterministic-inference with torch_native attention.

SGLang's batch-invariant mode swaps aten matmuls for Triton kernels, which exist only on accelerators.
On the CPU the batch-dependent op is the BLAS matmul: MKL computes a row differently when the matrix has
few rows (observed here: 1-3, 5-7, 9-11 rows with 2 threads), so in deterministic mode the linear layers
and the lm_head pad their input to MIN_ROWS rows. Every other op on this path is row-wise.
"""

import logging

import torch

logger = logging.getLogger(__name__)
MIN_ROWS = 16
_state = {"pad": False}


def _pad_rows(x):
    if not _state["pad"] or x.dim() != 2 or x.shape[0] >= MIN_ROWS:
        return x, None
    return torch.cat([x, x.new_zeros(MIN_ROWS - x.shape[0], x.shape[1])]), x.shape[0]


def _padded_apply(original, self, layer, x, bias=None):
    x, m = _pad_rows(x)
    out = original(self, layer, x, bias)
    return out if m is None else out[:m]


def _padded_lm_head(original, self, hidden_states, lm_head, embedding_bias=None, *, out=None):
    hidden_states, m = _pad_rows(hidden_states)
    if m is None:
        return original(self, hidden_states, lm_head, embedding_bias, out=out)
    return original(self, hidden_states, lm_head, embedding_bias, out=None)[:m]


def _maybe_enable(runner):
    from sglang.srt.runtime_context import get_exec

    if get_exec().deterministic.enable_deterministic_inference:
        _state["pad"] = True
        logger.info("CPU batch-invariant mode: linear layers and lm_head pad to %d rows", MIN_ROWS)


def register():
    from sglang.srt.arg_groups.choices import (DETERMINISTIC_ATTENTION_BACKEND_CHOICES,
                                               add_deterministic_attention_backend_choices)
    from sglang.srt.layers import sampler
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if "torch_native" not in DETERMINISTIC_ATTENTION_BACKEND_CHOICES:
        add_deterministic_attention_backend_choices(["torch_native"])
    HookRegistry.register("sglang.srt.model_executor.model_runner.ModelRunner.maybe_enable_batch_invariant_mode",
                          _maybe_enable, HookType.REPLACE)
    # torch.compile of multinomial_with_seed costs 1.5-2 min of inductor work on the CPU at the first
    # seeded sample; the eager function draws the same samples.
    HookRegistry.register("sglang.srt.layers.sampler.multinomial_with_seed",
                          sampler.multinomial_with_seed._torchdynamo_orig_callable, HookType.REPLACE)
    for cls in ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"):
        HookRegistry.register(f"sglang.srt.layers.quantization.unquant.{cls}.apply", _padded_apply, HookType.AROUND)
    HookRegistry.register("sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head", _padded_lm_head,
                          HookType.AROUND)
