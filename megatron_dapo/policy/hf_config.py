"""Read a Hugging Face `config.json` into the architecture-neutral ModelSpec the builder needs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megatron_dapo.config import ConfigError

# architecture -> (QKV bias by default, q/k RMSNorm per head)
SUPPORTED_ARCHITECTURES = {
    "Qwen2ForCausalLM": (True, False),
    "LlamaForCausalLM": (False, False),
    "Qwen3ForCausalLM": (False, True),
}
REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                 "max_position_embeddings", "rms_norm_eps")


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


def _rope_theta(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling")
    rope_type = params.get("rope_type", (scaling or {}).get("rope_type", (scaling or {}).get("type", "default")))
    if rope_type not in (None, "default"):
        raise ConfigError(f"rope_scaling: rope type {rope_type!r} is not supported yet; only the default rotary "
                          "embedding is")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    return float(theta)


def model_spec_from_hf(config) -> ModelSpec:
    """`config` is a path to config.json, the folder that holds it, or the parsed dict."""
    if not isinstance(config, dict):
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ConfigError(f"model.hf_config: no config.json at {path}")
        config = json.loads(path.read_text())
    archs = config.get("architectures") or []
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"architectures: {archs!r} is not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    arch = archs[0]
    missing = [k for k in REQUIRED_KEYS if k not in config]
    if missing:
        raise ConfigError(f"{missing[0]}: missing from config.json (needed: {', '.join(REQUIRED_KEYS)})")
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
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
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
        rope_theta=_rope_theta(config),
        qkv_bias=bool(config.get("attention_bias", default_bias)),
        qk_layernorm=qk_norm,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )
