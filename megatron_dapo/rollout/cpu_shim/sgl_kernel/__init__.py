"""CPU stand-in for SGLang's `sgl_kernel` (whose wheels are CUDA-only), put on the server's PYTHONPATH
only when SGLang runs on the CPU. On that path SGLang computes with its own torch-native code and
asks sgl_kernel for two bookkeeping ops, and for a hash in its seeded (deterministic) sampler; anything
else fails loudly when called.
"""

import ctypes

import torch
from murmur_hash import murmur_hash32


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """For each request row r with token range [s, e), store the next e - s cache slots at req_to_token[r, s:e]."""
    taken = 0
    for row, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        req_to_token[row, s:e] = out_cache_loc[taken:taken + (e - s)]
        taken += e - s


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """For each layer's KV buffer (its address and row stride in bytes), copy row src_loc[i] to tgt_loc[i]."""
    pairs = list(zip(tgt_loc.tolist(), src_loc.tolist()))
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        for tgt, src in pairs:
            ctypes.memmove(ptr + tgt * stride, ptr + src * stride, stride)


@torch.library.custom_op("sgl_kernel::murmur_hash32_cpu", mutates_args=())
def murmur_hash32_cpu(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    return murmur_hash32(seed, positions, col_indices)


@murmur_hash32_cpu.register_fake
def _(seed, positions, col_indices):
    return seed.new_empty((seed.shape[0], col_indices.shape[0]), dtype=torch.uint32)


def __getattr__(name):
    # SGLang imports some kernels at module import (speculative decoding) that this setup never runs:
    # hand out a function that fails loudly if it ever is called.
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is not available in megatron-dapo's CPU stand-in for "
                                  "sgl_kernel; this SGLang code path needs the CUDA kernels (run SGLang on a GPU)")

    missing.__name__ = name
    return missing


__all__ = ["assign_req_to_token_pool_cpu", "copy_all_layer_kv_cache_cpu", "murmur_hash32_cpu"]
