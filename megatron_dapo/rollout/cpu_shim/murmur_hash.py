"""MurmurHash3 (32-bit) of (seed, position, vocabulary column), in plain torch int64 arithmetic: the hash
SGLang's seeded sampler turns into Gumbel noise. Bitwise equal to SGLang's Triton kernel."""

import torch

M32 = 0xFFFFFFFF


def _mul32(x, c):
    # The low 32 bits of x * c, without int64 overflow: c is split into 16-bit halves.
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & M32


def _rotl32(x, r):
    return ((x << r) | (x >> (32 - r))) & M32


def _mix(h, k):
    k = _mul32(_rotl32(_mul32(k, 0xCC9E2D51), 15), 0x1B873593)
    h = _rotl32(h ^ k, 13)
    return (_mul32(h, 5) + 0xE6546B64) & M32


def _finalize(h):
    h = _mul32(h ^ (h >> 16), 0x85EBCA6B)
    h = _mul32(h ^ (h >> 13), 0xC2B2AE35)
    return h ^ (h >> 16)


def murmur_hash32(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    """[rows, columns] uint32 hashes of (seed[r] as two 32-bit words, positions[r], col_indices[c])."""
    s = seed.to(torch.int64).view(-1, 1)
    h = torch.zeros_like(s)
    for word in (s & M32, (s >> 32) & M32, positions.to(torch.int64).view(-1, 1) & M32):
        h = _mix(h, word)
    h = _mix(h, col_indices.to(torch.int64).view(1, -1) & M32)
    return _finalize(h ^ 16).to(torch.uint32)
