"""Core attention for megatron-core's local layer spec on torch's fused scaled_dot_product_attention.

Without Transformer Engine the local spec attends with megatron's `DotProductAttention`, which
materialises the [b, heads/TP, sq, sk] scores and probabilities (about 14 GB per layer at 22.5k
tokens). `SdpaAttention` is a drop-in replacement (same constructor and forward) that hands the
work to `torch.nn.functional.scaled_dot_product_attention`, whose flash / memory-efficient kernels
(GPU) and flash kernel (CPU) never hold the full score matrix, and which groups query heads onto
their KV heads (GQA) without copying the keys and values.

It covers what this project runs: causal self-attention (sq == sk), decoding against megatron's
static KV cache (sq == 1, no mask), an explicit boolean mask (True where attention is NOT allowed,
megatron's convention), packed sequences (megatron's `thd` format, causal within each sequence), and context
parallelism without Transformer Engine (policy/context_parallel.py: the keys and values all-gathered over the CP
group, each local query chunk attending its sequence's keys up to its own, masked by global positions; what the
suite tests CP's data path with, on CPU; on GPUs Transformer Engine's ring attention is the one to use).
Anything else raises instead of computing something different.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention

from megatron_dapo.policy.context_parallel import AttentionPlan

_MASK_TYPES = (AttnMaskType.causal, AttnMaskType.padding, AttnMaskType.no_mask)


# Packed sequences attend in buckets of similar length, each bucket one SDPA call over its sequences right-padded
# to its longest: a bucket's longest is at most this much its shortest, which bounds the attention spent on padding,
# while a pack of many short sequences takes a few calls instead of one per sequence.
BUCKET_RATIO = 1.25


@dataclass
class PackedSequences(PackedSeqParams):
    """megatron-core's `thd` parameters (cu_seqlens on the device, for its rotary embedding and TE's attention), and
    SdpaAttention's plan for the pack, made once per micro-batch rather than in every layer: `buckets`, per bucket
    (the rows of the pack its sequences gather, [sequences, longest], past a sequence's end its last row again;
    which of the gathered rows are real), and `restore`, which puts the buckets' real rows back in pack order.
    With context parallelism `cu_seqlens` are the whole pack's (megatron-core's rotary embedding divides them by
    CP) and `context_parallel` is this rank's AttentionPlan instead of buckets."""
    buckets: tuple = ()
    restore: Optional[Tensor] = None
    context_parallel: Optional[AttentionPlan] = None

    @classmethod
    def of(cls, cu_seqlens: list[int], device) -> PackedSequences:
        starts, lengths = cu_seqlens[:-1], [b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]
        cu = torch.tensor(cu_seqlens, dtype=torch.int32, device=device)
        cp = parallel_state.get_context_parallel_world_size()
        if cp > 1:
            plan = AttentionPlan.of(list(zip(starts, cu_seqlens[1:])), cp, parallel_state.get_context_parallel_rank(),
                                    device)
            return cls(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                       max_seqlen_kv=max(lengths), cp_group=parallel_state.get_context_parallel_group(),
                       context_parallel=plan)
        groups: list[list[int]] = []
        for i in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):
            if groups and lengths[i] <= BUCKET_RATIO * lengths[groups[-1][0]]:
                groups[-1].append(i)
            else:
                groups.append([i])
        buckets, order = [], []
        for group in groups:
            longest = max(lengths[i] for i in group)
            span = torch.arange(longest)
            rows = torch.stack([starts[i] + span.clamp(max=lengths[i] - 1) for i in group])
            real = torch.cat([span < lengths[i] for i in group])
            order.append(rows.reshape(-1)[real])
            buckets.append((rows.to(device), real.nonzero().squeeze(1).to(device)))
        return cls(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                   max_seqlen_kv=max(lengths), buckets=tuple(buckets), restore=torch.cat(order).argsort().to(device))


class SdpaAttention(MegatronModule):
    """Drop-in for megatron-core's local DotProductAttention: query [sq, b, np, hn] and key / value
    [sk, b, ng, hn] of this TP partition in, context [sq, b, np * hn] out."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        refusals = [
            (dropout > 0, f"attention dropout {dropout} (the transformer config sets attention_dropout=0.0)"),
            (config.softmax_type != "vanilla", f"softmax_type={config.softmax_type!r}"),
            (is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number),
             "sliding-window attention"),
            (attn_mask_type not in _MASK_TYPES, f"attn_mask_type={attn_mask_type}"),
        ]
        for refused, what in refusals:
            if refused:
                raise ValueError(f"SdpaAttention (layer {layer_number}) does not support {what}")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        # None: SDPA's own 1/sqrt(hn). apply_query_key_layer_scaling divides the scale by the layer number
        # and multiplies it back in the softmax (an fp16 overflow guard), so it leaves the result unchanged.
        self.softmax_scale = softmax_scale
        self.cp_group = pg_collection.cp if pg_collection is not None and hasattr(pg_collection, "cp") else \
            parallel_state.get_context_parallel_group(check_initialized=False)
        self.cp_size = config.context_parallel_size

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        if attention_bias is not None:
            raise ValueError("SdpaAttention does not support an attention_bias")
        if packed_seq_params is not None:
            return self._packed(query, key, value, attention_mask, packed_seq_params)
        sq, sk = query.size(0), key.size(0)
        if self.cp_size > 1:
            if attention_mask is not None or self.attn_mask_type != AttnMaskType.causal or sq != sk:
                raise ValueError(f"SdpaAttention (layer {self.layer_number}): context parallelism supports causal "
                                 f"self-attention only, got attn_mask_type={self.attn_mask_type}, "
                                 f"{'an' if attention_mask is not None else 'no'} attention_mask, {sq} queries and "
                                 f"{sk} keys")
            plan = _row_plan(sq * self.cp_size, self.cp_size, self.cp_group.rank(), query.device)
            return self._context_parallel(query, key, value, plan)
        # The masking follows the local DotProductAttention, which ignores the forward's attn_mask_type
        # and uses the module's own: a mask that is passed replaces the causal one; without one, causal
        # self-attention masks the future, and a single query (decoding against a KV cache) sees every key.
        mask, causal = None, False
        if attention_mask is not None:
            # megatron: True = masked out; SDPA: True = may attend. A query row masked entirely (padding)
            # comes out 0 on CPU, where megatron's -10000 fill averages all values: both are garbage rows.
            mask = ~attention_mask
        elif self.attn_mask_type == AttnMaskType.causal and sq > 1:
            if sq != sk:  # SDPA aligns a non-square causal mask top-left; megatron's local path refuses it too
                raise ValueError(f"SdpaAttention: causal attention needs as many queries as keys or a single "
                                 f"query (decoding), got {sq} queries and {sk} keys without an attention_mask")
            causal = True
        # [s, b, heads, hn] -> [b, heads, s, hn]: views; the kernels need only the last dimension contiguous.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.softmax_scale,
                                                 enable_gqa=q.size(1) != k.size(1))
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return context.permute(2, 0, 1, 3).reshape(sq, query.size(1), -1)

    def _packed(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                params: PackedSeqParams) -> Tensor:
        """Sequences end to end (megatron's `thd`: query [t, np, hn], key / value [t, ng, hn]), each attending
        causally to itself only: per bucket of similar lengths (PackedSequences) one causal SDPA over its sequences
        right-padded, which no real query sees (the padding comes after each sequence's own keys). No [t, t] mask
        is ever built, so the flash kernels serve."""
        packed = isinstance(params, PackedSequences)
        refusals = [
            (params.qkv_format != "thd", f"qkv_format={params.qkv_format!r}"),
            (attention_mask is not None, "an attention_mask beside packed sequences"),
            (self.attn_mask_type != AttnMaskType.causal, f"attn_mask_type={self.attn_mask_type} when packed"),
            (not packed, "packed_seq_params other than PackedSequences, which carry the pack's plan"),
        ]
        for refused, what in refusals:
            if refused:
                raise ValueError(f"SdpaAttention (layer {self.layer_number}) does not support {what}")
        if params.context_parallel is not None:  # a pack is one row: [t, heads, hn] -> [t, 1, heads, hn]
            out = self._context_parallel(*(t.unsqueeze(1) for t in (query, key, value)), params.context_parallel)
            return out.squeeze(1)
        heads, dim = query.shape[1:]
        outs = []
        for rows, real in params.buckets:
            # [sequences, longest, heads, hn] -> [sequences, heads, longest, hn]
            q, k, v = (t[rows].permute(0, 2, 1, 3) for t in (query, key, value))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                                 enable_gqa=q.size(1) != k.size(1))
            outs.append(out.permute(0, 2, 1, 3).reshape(-1, heads, dim)[real])
        return torch.cat(outs)[params.restore].reshape(query.size(0), -1)  # [t, np * hn]

    def _context_parallel(self, query: Tensor, key: Tensor, value: Tensor, plan: AttentionPlan) -> Tensor:
        """This CP rank's queries [s, b, np, hn] against every CP rank's keys and values [s, b, ng, hn] (gathered:
        their gradients come back summed over the ranks whose queries used them), chunk by chunk as `plan` says;
        context [s, b, np * hn]."""
        k, v = (gather_from_sequence_parallel_region(t, tensor_parallel_output_grad=True, group=self.cp_group)
                .index_select(0, plan.global_rows) for t in (key, value))
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, k, v))  # [b, heads, s, hn]
        outs = []
        for start, n, key_start, keys in plan.chunks:
            # The chunk's queries are the last n of its keys: query i sees keys up to keys - n + i.
            mask = torch.ones(n, keys, dtype=torch.bool, device=q.device).tril(keys - n)
            span = slice(key_start, key_start + keys)
            outs.append(F.scaled_dot_product_attention(q[:, :, start:start + n], k[:, :, span], v[:, :, span],
                                                       attn_mask=mask, scale=self.softmax_scale,
                                                       enable_gqa=q.size(1) != k.size(1)))
        context = torch.cat(outs, dim=2).permute(2, 0, 1, 3)  # [s, b, np, hn]
        return context.reshape(context.shape[0], context.shape[1], -1)


@functools.lru_cache(maxsize=16)
def _row_plan(length: int, cp_size: int, cp_rank: int, device) -> AttentionPlan:
    """The AttentionPlan of a padded block's rows, `length` tokens each before the cut (the same for every row)."""
    return AttentionPlan.of([(0, length)], cp_size, cp_rank, device)
