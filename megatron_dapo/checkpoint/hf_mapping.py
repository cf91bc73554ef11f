"""The one place that knows Hugging Face parameter names: HF <-> Megatron names and layouts.

Megatron names here are *global*: `decoder.layers.{i}` counts layers over all pipeline stages. Per
tensor-parallel rank, Megatron holds:
- linear_qkv: q, k and v fused per query group ([q heads of the group, k, v] for each group), the
  groups split across ranks;
- linear_fc1: [gate shard; up shard] of the SwiGLU MLP, so each rank's fc1 holds both halves;
- word embeddings and output layer: rows padded to the padded vocabulary, split by rows;
- linear_proj, linear_fc2: split by input columns; norms replicated.
Both the local and the Transformer Engine layer specs' names are understood, in both directions: TE
fuses the two pre-norms into the next linear layer (`linear_qkv.layer_norm_weight`,
`linear_fc1.layer_norm_weight`), and megatron-core's checkpoints store the local spec's norms under
those names too.

A mixture of experts' layer (Qwen3-MoE) holds a router (`mlp.router.weight`, HF's `mlp.gate.weight`),
its pre-MLP norm as a module of its own in both specs, and its experts, each whole on one expert-parallel
rank (no expert tensor parallelism): the local spec's `mlp.experts.local_experts.{j}.linear_fc1/fc2`,
TE's grouped `mlp.experts.linear_fc1.weight{j}`. Global names number the experts over all
expert-parallel ranks, as they number the layers over all stages. GLM-4.5's layers add the router's expert bias
(`mlp.router.expert_bias`, HF's `mlp.gate.e_score_correction_bias`: a buffer, kept in fp32 on both sides) and a
shared expert (`mlp.shared_experts.linear_fc1/fc2`, split over TP as a dense MLP is); Qwen2-MoE's layers a shared
expert under HF's `mlp.shared_expert.` and its gate (`mlp.shared_experts.gate_weight`, HF's
`mlp.shared_expert_gate.weight`).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from megatron_dapo.errors import DapoError
from megatron_dapo.policy.hf_config import ModelSpec

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# An expert's tensor inside a layer: the local spec's SequentialMLP, or TE's grouped experts
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")

HF_EMBEDDING = "model.embed_tokens.weight"
HF_OUTPUT = "lm_head.weight"
HF_FINAL_NORM = "model.norm.weight"
# Buffers some checkpoints carry that config.json already defines (the rotary frequencies).
HF_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)

# Local-spec norm -> its Transformer Engine name (fused into the linear layer that follows it).
TE_FUSED_NORMS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                  "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
# Megatron suffix inside a layer -> HF suffix inside `model.layers.{i}.` (one-to-one tensors).
_LAYER_DIRECT = {
    "input_layernorm.weight": "input_layernorm.weight",
    TE_FUSED_NORMS["input_layernorm.weight"]: "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    TE_FUSED_NORMS["pre_mlp_layernorm.weight"]: "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
}
# Megatron tensors kept in fp32 whatever the model's dtype (and so in the exported files): the expert bias, which
# only orders the experts' scores, where bf16 would tie them.
FP32_SUFFIXES = ("mlp.router.expert_bias",)
# Tensor-parallel split dimension of each Megatron suffix (None: replicated).
_LAYER_TP_DIM = {
    "self_attention.linear_qkv.weight": 0,
    "self_attention.linear_qkv.bias": 0,
    "self_attention.linear_proj.weight": 1,
    "mlp.linear_fc1.weight": 0,
    "mlp.linear_fc2.weight": 1,
    "mlp.shared_experts.linear_fc1.weight": 0,
    "mlp.shared_experts.linear_fc2.weight": 1,
}


class MappingError(DapoError, KeyError):
    """A tensor name with no counterpart, or a shape that disagrees with the model's config."""

    def __str__(self) -> str:
        return str(self.args[0])


def layer_index(mname: str) -> int | None:
    """The (global) layer of Megatron tensor `mname`, or None for the embeddings, final norm and output layer."""
    match = _LAYER.match(mname)
    return int(match.group(1)) if match else None


def expert_of(mname: str) -> tuple[int, str] | None:
    """(expert index, "linear_fc1" | "linear_fc2") of an expert's tensor, in either spec's naming; else None."""
    match = _LAYER.match(mname)
    if match is None:
        return None
    suffix = match.group(2)
    local, grouped = _LOCAL_EXPERT.match(suffix), _GROUPED_EXPERT.match(suffix)
    if local:
        return int(local.group(1)), local.group(2)
    if grouped:
        return int(grouped.group(2)), grouped.group(1)
    return None


def renumber_expert(name: str, offset: int) -> str:
    """An expert tensor's name with its expert index moved by `offset` (local <-> global numbering); other names
    as they are."""
    match = _LAYER.match(name)
    if match is None:
        return name
    head = name[: match.start(2)]
    suffix = _LOCAL_EXPERT.sub(lambda m: f"mlp.experts.local_experts.{int(m.group(1)) + offset}.{m.group(2)}.weight",
                               match.group(2))
    suffix = _GROUPED_EXPERT.sub(lambda m: f"mlp.experts.{m.group(1)}.weight{int(m.group(2)) + offset}", suffix)
    return head + suffix


def hf_names(mname: str, spec: ModelSpec) -> list[str]:
    """The HF tensors that make up the Megatron tensor `mname` (global layer numbering)."""
    if mname == "embedding.word_embeddings.weight":
        return [HF_EMBEDDING]
    if mname == "output_layer.weight":
        return [HF_EMBEDDING if spec.tie_word_embeddings else HF_OUTPUT]
    if mname == "decoder.final_layernorm.weight":
        return [HF_FINAL_NORM]
    match = _LAYER.match(mname)
    if match is None:
        raise MappingError(f"no Hugging Face counterpart for Megatron tensor {mname!r}")
    layer, suffix = int(match.group(1)), match.group(2)
    prefix = f"model.layers.{layer}."
    expert = expert_of(mname)
    if expert is not None:
        j, linear = expert
        parts = ("gate_proj", "up_proj") if linear == "linear_fc1" else ("down_proj",)
        return [f"{prefix}mlp.experts.{j}.{part}.weight" for part in parts]
    if suffix in _LAYER_DIRECT:
        return [prefix + _LAYER_DIRECT[suffix]]
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        return [f"{prefix}self_attn.{p}_proj.{kind}" for p in "qkv"]
    if suffix == "mlp.linear_fc1.weight":
        return [prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight"]
    if suffix == "mlp.shared_experts.linear_fc1.weight":
        shared = prefix + shared_expert_prefix(spec)
        return [shared + "gate_proj.weight", shared + "up_proj.weight"]
    if suffix == "mlp.shared_experts.linear_fc2.weight":
        return [prefix + shared_expert_prefix(spec) + "down_proj.weight"]
    raise MappingError(f"no Hugging Face counterpart for Megatron tensor {mname!r}")


def shared_expert_prefix(spec: ModelSpec) -> str:
    """Where a checkpoint keeps the shared expert's MLP inside a layer: Qwen2-MoE's one `shared_expert`, GLM-4.5's
    `shared_experts`."""
    return "mlp.shared_expert." if spec.architecture == "Qwen2MoeForCausalLM" else "mlp.shared_experts."


def megatron_names(spec: ModelSpec, *, te_names: bool = False) -> list[str]:
    """Every Megatron tensor of the model (global layer numbering), with the local spec's names or, with
    `te_names`, Transformer Engine's; in the same order either way."""
    def layer(sparse: bool) -> list[str]:
        attention = ["input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight"]
        if sparse:  # the pre-MLP norm stays a module of its own beside the router, in both specs
            mlp = ["pre_mlp_layernorm.weight", "mlp.router.weight"]
            if spec.expert_bias:
                mlp.append("mlp.router.expert_bias")
            if spec.shared_expert_ffn_hidden_size:
                mlp += ["mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight"]
            if spec.shared_expert_gate:
                mlp.append("mlp.shared_experts.gate_weight")
            for j in range(spec.num_experts):
                mlp += ([f"mlp.experts.linear_fc1.weight{j}", f"mlp.experts.linear_fc2.weight{j}"] if te_names else
                        [f"mlp.experts.local_experts.{j}.linear_fc1.weight",
                         f"mlp.experts.local_experts.{j}.linear_fc2.weight"])
        else:
            mlp = ["pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
        names = attention + mlp
        if te_names:
            names = [TE_FUSED_NORMS.get(s, s) if not (sparse and s == "pre_mlp_layernorm.weight") else s
                     for s in names]
        if spec.qkv_bias:
            names.append("self_attention.linear_qkv.bias")
        if spec.qk_layernorm:
            names += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
        return names

    sparse = spec.moe_layers or (False,) * spec.num_layers
    names = ["embedding.word_embeddings.weight"]
    names += [f"decoder.layers.{i}.{s}" for i in range(spec.num_layers) for s in layer(sparse[i])]
    names.append("decoder.final_layernorm.weight")
    if not spec.tie_word_embeddings:
        names.append("output_layer.weight")
    return names


def uses_te_names(names) -> bool:
    """Whether parameter names are Transformer Engine's (its fused norms) rather than the local spec's."""
    fused = tuple(TE_FUSED_NORMS.values())
    return any(n.endswith(fused) for n in names)


def expected_hf_names(spec: ModelSpec) -> set[str]:
    """The HF tensor names a checkpoint of this model holds."""
    return {n for mname in megatron_names(spec) for n in hf_names(mname, spec)}


def tp_dim(mname: str) -> int | None:
    """The dimension Megatron splits `mname` along across tensor-parallel ranks, or None."""
    if mname in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return 0
    match = _LAYER.match(mname)
    if match is None or expert_of(mname) is not None:  # experts stay whole (expert tensor parallelism 1)
        return None
    return _LAYER_TP_DIM.get(match.group(2))


def hf_shape(hf_name: str, spec: ModelSpec) -> tuple[int, ...]:
    """The shape config.json implies for HF tensor `hf_name`."""
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_attention_heads * d, spec.num_query_groups * d
    table = {
        "embed_tokens.weight": (spec.vocab_size, h), "lm_head.weight": (spec.vocab_size, h),
        "norm.weight": (h,), "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "q_proj.weight": (q, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h),
        "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,), "o_proj.weight": (h, q),
        "q_norm.weight": (d,), "k_norm.weight": (d,),
        "gate_proj.weight": (spec.ffn_hidden_size, h), "up_proj.weight": (spec.ffn_hidden_size, h),
        "down_proj.weight": (h, spec.ffn_hidden_size), "gate.weight": (spec.num_experts, h),
        "gate.e_score_correction_bias": (spec.num_experts,), "shared_expert_gate.weight": (1, h),
    }
    key = ".".join(hf_name.split(".")[-2:])
    if ".mlp.experts." in hf_name or ".mlp.shared_expert" in hf_name and key != "shared_expert_gate.weight":
        f = spec.moe_ffn_hidden_size if ".mlp.experts." in hf_name else spec.shared_expert_ffn_hidden_size
        return {"gate_proj.weight": (f, h), "up_proj.weight": (f, h), "down_proj.weight": (h, f)}[key]
    return table[key]


def kept_dtype(mname: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype Megatron tensor `mname` is kept and exported in, in a model of `dtype` (FP32_SUFFIXES)."""
    return torch.float32 if mname.endswith(FP32_SUFFIXES) else dtype


def mtp_layer(hf_name: str, spec: ModelSpec) -> bool:
    """Whether `hf_name` is a multi-token prediction layer's (ModelSpec.mtp_layers: after the decoder's layers)."""
    match = re.match(r"^model\.layers\.(\d+)\.", hf_name)
    return match is not None and spec.num_layers <= int(match.group(1)) < spec.num_layers + spec.mtp_layers


def megatron_shape(mname: str, spec: ModelSpec, padded_vocab_size: int) -> tuple[int, ...]:
    """The full (unsplit) shape of Megatron tensor `mname`."""
    shapes = [hf_shape(n, spec) for n in hf_names(mname, spec)]
    if mname in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return (padded_vocab_size, *shapes[0][1:])
    return (sum(s[0] for s in shapes), *shapes[0][1:])  # fused tensors stack their parts' rows


def _fetch(get: Callable[[str], torch.Tensor], name: str, spec: ModelSpec) -> torch.Tensor:
    tensor = get(name)
    expected = hf_shape(name, spec)
    if tuple(tensor.shape) != expected:
        raise MappingError(f"{name}: shape {tuple(tensor.shape)} disagrees with config.json, which implies {expected}")
    return tensor


def megatron_shard(mname: str, get: Callable[[str], torch.Tensor], spec: ModelSpec, *, tp_rank: int, tp_size: int,
                   padded_vocab_size: int) -> torch.Tensor:
    """This tensor-parallel rank's shard of Megatron tensor `mname`, built from HF tensors `get(name)`."""
    names = hf_names(mname, spec)
    parts = [_fetch(get, n, spec) for n in names]
    dim = tp_dim(mname)
    if dim is None:  # replicated over the tensor-parallel ranks: the whole tensor on each
        tp_rank, tp_size = 0, 1
    if mname in ("embedding.word_embeddings.weight", "output_layer.weight"):
        full = parts[0]
        pad = padded_vocab_size - full.shape[0]
        full = torch.cat([full, full.new_zeros(pad, full.shape[1])]) if pad else full
    elif mname.endswith("linear_qkv.weight") or mname.endswith("linear_qkv.bias"):
        g = spec.num_query_groups
        q, k, v = (p.reshape(g, -1, *p.shape[1:]) for p in parts)
        full = torch.cat([q, k, v], dim=1).reshape(-1, *parts[0].shape[1:])
    elif mname.endswith("linear_fc1.weight"):
        gate, up = (p.chunk(tp_size, dim=0)[tp_rank] for p in parts)
        return torch.cat([gate, up], dim=0)
    else:
        full = parts[0]
    if dim is None:
        return full
    return full.chunk(tp_size, dim=dim)[tp_rank]


def hf_tensors(mname: str, shards: list[torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The HF tensors held by Megatron tensor `mname`, from its shards on every tensor-parallel rank."""
    names = hf_names(mname, spec)
    dim = tp_dim(mname)
    if mname.endswith("linear_fc1.weight"):
        halves = [s.chunk(2, dim=0) for s in shards]
        return {names[0]: torch.cat([h[0] for h in halves]), names[1]: torch.cat([h[1] for h in halves])}
    full = shards[0] if dim is None or len(shards) == 1 else torch.cat(shards, dim=dim)
    if mname in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return {names[0]: full[: spec.vocab_size]}
    if mname.endswith("linear_qkv.weight") or mname.endswith("linear_qkv.bias"):
        g, d = spec.num_query_groups, spec.head_dim
        per_group = spec.num_attention_heads // g
        grouped = full.reshape(g, per_group + 2, d, *full.shape[1:])
        q, k, v = grouped.split([per_group, 1, 1], dim=1)
        return {n: t.reshape(-1, *full.shape[1:]) for n, t in zip(names, (q, k, v))}
    return {names[0]: full}
