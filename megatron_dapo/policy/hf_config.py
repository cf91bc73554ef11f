"""Read a Hugging Face `config.json` into the architecture-neutral ModelSpec the builder needs."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from megatron_dapo.config import ConfigError
from megatron_dapo.user_files import read_json

# architecture -> (QKV bias by default, q/k RMSNorm per head)
SUPPORTED_ARCHITECTURES = {
    "Qwen2ForCausalLM": (True, False),
    "LlamaForCausalLM": (False, False),
    "Qwen3ForCausalLM": (False, True),
    "Qwen3MoeForCausalLM": (False, True),
    "Glm4MoeForCausalLM": (False, False),  # q/k norms as config.json's use_qk_norm says
    "Qwen2MoeForCausalLM": (True, False),
}
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "Glm4MoeForCausalLM")
# Mixtures of experts whose layers megatron-core could build but whose mapping is not written yet: refused by name.
REFUSED_ARCHITECTURES = {
    "DeepseekV3ForCausalLM": "multi-head latent attention, sigmoid routing with expert bias and multi-token prediction "
                             "are not mapped yet",
}
MOE_REQUIRED_KEYS = ("moe_intermediate_size", "num_experts_per_tok")
REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                 "max_position_embeddings", "rms_norm_eps")
# transformers' rope_type values the builder reproduces; the others (linear, dynamic, yarn, longrope, ...) are refused
ROPE_TYPES = ("default", "llama3")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """`rope_type: llama3` (Llama 3.1 - 3.3): rotations of wavelength over original_max_position_embeddings /
    low_freq_factor slowed by `factor`, those under original_max_position_embeddings / high_freq_factor kept, the
    ones between interpolated. The fields are config.json's keys, and the arguments of megatron-core's
    RotaryEmbedding._apply_scaling (policy/model.py)."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    qkv_bias: bool
    qk_layernorm: bool
    tie_word_embeddings: bool
    rope_scaling: Llama3RopeScaling | None = None  # None: the unscaled rotary embedding
    # Mixture of experts (0 experts: a dense model). moe_layers[i]: whether layer i's MLP is the experts' (the
    # others are dense MLPs of ffn_hidden_size).
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_layers: tuple[bool, ...] = ()
    # True: the top-k probabilities are renormalised to sum to 1 (softmax over the k logits); False: they stay the
    # softmax over all experts.
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.0
    # GLM-4.5-style routing (DeepSeek-V3's): "sigmoid" scores, with a per-expert bias (config.json's
    # e_score_correction_bias) added for the choice only; the token's best `moe_group_topk` of `moe_groups` groups
    # of experts first (0: no groups); the k probabilities times `routed_scaling_factor`
    router_score: str = "softmax"
    expert_bias: bool = False
    moe_groups: int = 0
    moe_group_topk: int = 0
    routed_scaling_factor: float = 1.0
    # A shared expert beside the routed ones in every MoE layer, this wide (0: none); with a gate (Qwen2-MoE's), its
    # output times sigmoid(a linear map of the layer's input to one number)
    shared_expert_ffn_hidden_size: int = 0
    shared_expert_gate: bool = False
    # The share of each head's dimensions the rotary embedding turns (the first ones); the rest pass unrotated
    rotary_percent: float = 1.0
    # Multi-token prediction layers a checkpoint holds after the decoder's (GLM-4.5's num_nextn_predict_layers):
    # not trained or exported here
    mtp_layers: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def spec_differences(saved: dict, spec: ModelSpec, label: str) -> list[str]:
    """Where `saved` (a ModelSpec as a JSON record holds it: tuples as lists) differs from `spec`, each as
    "field=saved (label: spec's)"; a field the record predates has its default (a dense model's no experts)."""
    mine = json.loads(json.dumps(dataclasses.asdict(spec)))
    defaults = {f.name: f.default for f in dataclasses.fields(spec) if f.default is not dataclasses.MISSING}
    saved = json.loads(json.dumps({**defaults, **saved}))
    return [f"{k}={saved.get(k)!r} ({label}: {v!r})" for k, v in mine.items() if saved.get(k) != v]


def _rope(cfg: dict) -> tuple[float, Llama3RopeScaling | None]:
    """The rotary base and scaling as transformers 5 reads them: a non-empty rope_scaling (the name Llama 3's
    published configs use) whole in place of rope_parameters, rope_theta from that dict or else the top level."""
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    params = cfg.get(key) or {}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{key}.rope_type: {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return theta, None
    missing = [k for k in LLAMA3_ROPE_KEYS if k not in params]
    if missing:
        raise ConfigError(f"{key}.{missing[0]}: missing (rope_type llama3 needs {', '.join(LLAMA3_ROPE_KEYS)})")
    return theta, Llama3RopeScaling(
        *(float(params[k]) for k in LLAMA3_ROPE_KEYS),
        int(params.get("original_max_position_embeddings", cfg["max_position_embeddings"])))


def model_spec_from_hf(config) -> ModelSpec:
    """`config` is a path to config.json, the folder that holds it, or the parsed dict."""
    if not isinstance(config, dict):
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ConfigError(f"model.hf_config: no config.json at {path}")
        config = read_json(path, error=ConfigError)
    archs = config.get("architectures") or []
    if len(archs) == 1 and archs[0] in REFUSED_ARCHITECTURES:
        raise ConfigError(f"architectures: {archs[0]} is not supported: {REFUSED_ARCHITECTURES[archs[0]]}; "
                          f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"architectures: {archs!r} is not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    arch = archs[0]
    missing = [k for k in REQUIRED_KEYS if k not in config]
    if missing:
        raise ConfigError(f"{missing[0]}: missing from config.json (needed: {', '.join(REQUIRED_KEYS)})")
    _check_numbers(config)
    if config.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act: {config['hidden_act']!r} is not supported; only 'silu' (SwiGLU) is")
    if config.get("use_sliding_window"):
        raise ConfigError("use_sliding_window: sliding-window attention is not supported; set it to false")
    if config.get("mlp_bias"):
        raise ConfigError("mlp_bias: MLP biases are not supported")
    heads = config["num_attention_heads"]
    groups = config.get("num_key_value_heads") or heads
    if heads % groups:
        raise ConfigError(f"num_key_value_heads: {groups} does not divide num_attention_heads {heads}")
    default_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
    if arch == "Glm4MoeForCausalLM":
        qk_norm = bool(config.get("use_qk_norm", False))
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope_theta, rope_scaling = _rope(config)
    if not (math.isfinite(rope_theta) and rope_theta > 0):
        raise ConfigError(f"rope_theta: must be a finite number > 0 in config.json, got {rope_theta!r}")
    return ModelSpec(
        architecture=arch,
        num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        ffn_hidden_size=config["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=head_dim,
        vocab_size=config["vocab_size"],
        max_position_embeddings=config["max_position_embeddings"],
        rms_norm_eps=float(config["rms_norm_eps"]),
        rope_theta=rope_theta,
        qkv_bias=bool(config.get("attention_bias", default_bias)),
        qk_layernorm=qk_norm,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        rope_scaling=rope_scaling,
        rotary_percent=_rotary_percent(config),
        **(_moe_fields(config) if arch in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM") else {}),
        **(_shared_expert_fields(config) if arch == "Qwen2MoeForCausalLM" else {}),
        **(_glm_moe_fields(config) if arch == "Glm4MoeForCausalLM" else {}),
    )


def _rotary_percent(config: dict) -> float:
    """partial_rotary_factor, where transformers 5 reads it (rope_parameters) or older configs put it (the top
    level): the rotary embedding turns the first head_dim x factor dimensions."""
    factor = (config.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                        config.get("partial_rotary_factor", 1.0))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor <= 1 \
            or int(head_dim * factor) % 2:
        raise ConfigError(f"partial_rotary_factor: must be in (0, 1] and turn an even number of head_dim {head_dim}'s "
                          f"dimensions, got {factor!r}")
    return float(factor)


WHOLE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
              "max_position_embeddings", "num_key_value_heads", "head_dim", "moe_intermediate_size")


def _check_numbers(config: dict) -> None:
    """config.json's sizes are whole numbers >= 1 and rms_norm_eps a small positive number: a hand-edited or
    corrupted config is named by key, not built into a model that fails (or computes garbage) later."""
    for key in WHOLE_KEYS:
        value = config.get(key)
        if value is None and key not in REQUIRED_KEYS:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{key}: must be a whole number >= 1 in config.json, got {value!r}")
    eps = config["rms_norm_eps"]
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not (math.isfinite(eps) and 0 < eps < 1):
        raise ConfigError(f"rms_norm_eps: must be a number in (0, 1) in config.json, got {eps!r}")


def _glm_moe_fields(config: dict) -> dict:
    """GLM-4.5's experts and router as transformers builds them (Glm4MoeTopkRouter): sigmoid scores, the bias
    e_score_correction_bias added for the choice, the best topk_group of n_group groups (each scored by its two best
    experts), the top k of those; the k scores renormalised (norm_topk_prob) and times routed_scaling_factor; a
    shared expert of n_shared_experts x moe_intermediate_size; the first first_k_dense_replace layers dense."""
    missing = [k for k in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size") if k not in config]
    if missing:
        raise ConfigError(f"{missing[0]}: missing from config.json (needed for GLM-4.5's experts)")
    experts, topk = config["n_routed_experts"], config["num_experts_per_tok"]
    layers = config["num_hidden_layers"]
    for key, value, low, high in (("n_routed_experts", experts, 1, None), ("num_experts_per_tok", topk, 1, experts),
                                  ("n_group", config.get("n_group", 1), 1, experts),
                                  ("topk_group", config.get("topk_group", 1), 1, config.get("n_group", 1)),
                                  ("first_k_dense_replace", config.get("first_k_dense_replace", 0), 0, layers - 1),
                                  ("n_shared_experts", config.get("n_shared_experts", 0), 0, None),
                                  ("num_nextn_predict_layers", config.get("num_nextn_predict_layers", 0), 0, None)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
            raise ConfigError(f"{key}: must be a whole number in [{low}, {high if high is not None else 'inf'}] in "
                              f"config.json, got {value!r}")
    groups, group_topk = config.get("n_group", 1), config.get("topk_group", 1)
    if experts % groups:
        raise ConfigError(f"n_group: {groups} does not divide n_routed_experts {experts}")
    if groups > 1 and topk != 2 * group_topk:
        # transformers scores a group by its 2 best experts, megatron-core by its top (num_experts_per_tok /
        # topk_group): the same choice only where that is 2 (DeepSeek-V3: 8 / 4)
        raise ConfigError(f"n_group: grouped routing with num_experts_per_tok {topk} and topk_group {group_topk} is "
                          "not supported: megatron-core scores a group by its top num_experts_per_tok / topk_group "
                          "experts and transformers by its top 2; supported where num_experts_per_tok = 2 x "
                          "topk_group, or with n_group 1")
    if not config.get("norm_topk_prob", False) and topk > 1:
        raise ConfigError("norm_topk_prob: false is not supported with sigmoid routing (megatron-core renormalises "
                          "the k scores); set it as the checkpoint was trained, which is true for GLM-4.5")
    scaling = config.get("routed_scaling_factor", 1.0)
    if not isinstance(scaling, (int, float)) or isinstance(scaling, bool) or not (math.isfinite(scaling)
                                                                                  and scaling > 0):
        raise ConfigError(f"routed_scaling_factor: must be a finite number > 0 in config.json, got {scaling!r}")
    dense = config.get("first_k_dense_replace", 0)
    return {"num_experts": experts, "moe_topk": topk, "moe_ffn_hidden_size": config["moe_intermediate_size"],
            "moe_layers": tuple(i >= dense for i in range(layers)), "norm_topk_prob": True,
            "router_aux_loss_coef": 0.0, "router_score": "sigmoid", "expert_bias": True,
            "moe_groups": groups if groups > 1 else 0, "moe_group_topk": group_topk if groups > 1 else 0,
            "routed_scaling_factor": float(scaling),
            "shared_expert_ffn_hidden_size": config.get("n_shared_experts", 0) * config["moe_intermediate_size"],
            "mtp_layers": config.get("num_nextn_predict_layers", 0)}


def _shared_expert_fields(config: dict) -> dict:
    """Qwen2-MoE's shared expert (shared_expert_intermediate_size wide) and its sigmoid gate."""
    width = config.get("shared_expert_intermediate_size")
    if not isinstance(width, int) or isinstance(width, bool) or width < 1:
        raise ConfigError(f"shared_expert_intermediate_size: must be a whole number >= 1 in config.json, got {width!r}")
    return {"shared_expert_ffn_hidden_size": width, "shared_expert_gate": True}


def _moe_fields(config: dict) -> dict:
    """Qwen3-MoE's and Qwen2-MoE's experts and router, as transformers builds them: layer i is sparse unless it is
    in mlp_only_layers, if (i + 1) % decoder_sparse_step == 0."""
    # transformers 5 writes num_local_experts; the published Qwen3-MoE configs say num_experts
    experts = config.get("num_experts", config.get("num_local_experts"))
    if not experts:
        raise ConfigError("num_experts: missing from config.json (a mixture of experts needs its expert count)")
    missing = [k for k in MOE_REQUIRED_KEYS if k not in config]
    if missing:
        raise ConfigError(f"{missing[0]}: missing from config.json (needed for a mixture of experts: "
                          f"{', '.join(MOE_REQUIRED_KEYS)})")
    topk = config["num_experts_per_tok"]
    if not 1 <= topk <= experts:
        raise ConfigError(f"num_experts_per_tok: {topk} must be in [1, num_experts = {experts}]")
    step = config.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise ConfigError(f"decoder_sparse_step: must be a whole number >= 1, got {step!r}")
    layers = config["num_hidden_layers"]
    dense = set(config.get("mlp_only_layers") or [])
    if not dense <= set(range(layers)):
        raise ConfigError(f"mlp_only_layers: {sorted(dense - set(range(layers)))} are not layers of this model "
                          f"(0 to {layers - 1})")
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    if not any(sparse):
        raise ConfigError("mlp_only_layers / decoder_sparse_step: no layer has experts; a dense model's "
                          "architecture is Qwen3ForCausalLM")
    return {"num_experts": experts, "moe_topk": topk, "moe_ffn_hidden_size": config["moe_intermediate_size"],
            "moe_layers": sparse, "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
            "router_aux_loss_coef": float(config.get("router_aux_loss_coef", 0.0))}
