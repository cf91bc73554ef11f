"""Build megatron-core's GPTModel for one pipeline stage from a ModelSpec."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from megatron_dapo.config import ConfigError, ParallelConfig, default_training_dtype
from megatron_dapo.parallel.runtime import builds_for_gpu, tensors_on_gpu
from megatron_dapo.policy.hf_config import ModelSpec

VOCAB_DIVISIBLE_BY = 128  # Megatron's default padding unit, times the TP size


def padded_vocab_size(vocab_size: int, tensor_parallel: int) -> int:
    unit = VOCAB_DIVISIBLE_BY * tensor_parallel
    return -(-vocab_size // unit) * unit


def check_divisibility(spec: ModelSpec, parallel: ParallelConfig) -> None:
    """The layouts megatron-core can build this model at; the others refused by the key to change."""
    tp, pp, ep = parallel.tensor_parallel, parallel.pipeline_parallel, parallel.expert_parallel
    checks = [
        ("num_attention_heads", spec.num_attention_heads, tp, "parallel.tensor_parallel"),
        ("num_key_value_heads", spec.num_query_groups, tp, "parallel.tensor_parallel"),
        ("num_hidden_layers", spec.num_layers, pp, "parallel.pipeline_parallel"),
    ]
    if not all(spec.moe_layers) or not spec.is_moe:  # the dense MLPs' (the experts' stay whole: no expert TP)
        checks.append(("intermediate_size", spec.ffn_hidden_size, tp, "parallel.tensor_parallel"))
    if spec.is_moe:
        checks.append(("num_experts", spec.num_experts, ep, "parallel.expert_parallel"))
    if spec.shared_expert_ffn_hidden_size:  # split over TP like a dense MLP
        checks.append(("n_shared_experts x moe_intermediate_size", spec.shared_expert_ffn_hidden_size, tp,
                       "parallel.tensor_parallel"))
    for key, value, size, size_key in checks:
        if value % size:
            raise ConfigError(f"{key}: {value} is not divisible by {size_key} = {size}; choose a size that divides it")
    if ep > 1 and not spec.is_moe:
        raise ConfigError(f"parallel.expert_parallel: {ep}, but {spec.architecture} is a dense model (no experts to "
                          "deal); set it to 1")
    if spec.is_moe and tp > 1 and not parallel.sequence_parallel:
        # megatron-core's MoE layer refuses to train so: its token dispatch expects the sequence split over TP
        raise ConfigError(f"parallel.sequence_parallel: a mixture of experts at parallel.tensor_parallel = {tp} needs "
                          "sequence parallelism; set parallel.sequence_parallel to true")


def use_transformer_engine(parallel: ParallelConfig) -> bool:
    if parallel.device != "cuda":
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def recompute_options(activation_recompute: str) -> dict:
    """megatron-core's TransformerConfig fields for model.activation_recompute. "full": every layer is its own
    checkpoint (uniform, one layer per unit): it keeps its input and recomputes the rest in the backward, only in
    training mode (megatron-core skips it under `model.eval()`). distribute_saved_activations stays off: splitting
    the kept inputs over the TP ranks costs an all-gather per layer in the backward, and megatron-core refuses it
    with sequence parallelism. (ModelConfig validates the value.)"""
    if activation_recompute == "none":
        return {}
    return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1,
            "distribute_saved_activations": False}


def transformer_config(spec: ModelSpec, parallel: ParallelConfig, params_dtype: torch.dtype | None = None,
                       initialize: bool = True, activation_recompute: str = "none",
                       moe_aux_loss_coef: float | None = None, routing_replay: bool = False):
    """bf16 on GPUs (and device-faithful on the CPU), else fp32, unless `params_dtype` says otherwise (the
    converter keeps the file's).
    `initialize=False` leaves the weights unset, for a model that is about to be filled from a checkpoint.
    `activation_recompute` is model.activation_recompute; only the trained model needs "full".
    `moe_aux_loss_coef`: model.moe_aux_loss_coef (see moe_options)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_divisibility(spec, parallel)
    dtype = params_dtype or getattr(torch, default_training_dtype(builds_for_gpu(parallel)))
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=parallel.tensor_parallel,
        pipeline_model_parallel_size=parallel.pipeline_parallel,
        context_parallel_size=parallel.context_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not tensors_on_gpu(parallel),
        perform_initialization=initialize,
        # Fusions that need apex / TE kernels stay off; TE's own layers fuse on GPU.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        attention_softmax_in_fp32=True,
        # Token-level loss: each micro-batch returns its summed loss and token count, and
        # finalize_model_grads divides the summed gradients by the count over the whole step.
        calculate_per_token_loss=True,
        # Micro-batches of different lengths through the pipeline schedules.
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",
        sequence_parallel=parallel.sequence_parallel,
        expert_model_parallel_size=parallel.expert_parallel,
        expert_tensor_parallel_size=1,
        **moe_options(spec, moe_aux_loss_coef, routing_replay),
        **recompute_options(activation_recompute),
    )


def moe_options(spec: ModelSpec, aux_loss_coef: float | None, routing_replay: bool = False) -> dict:
    """megatron-core's TransformerConfig fields for the model's experts and router, routing as transformers
    does: Qwen3-MoE's, a softmax over the experts and their top k; with norm_topk_prob the k probabilities
    renormalised, which is the softmax over the k logits (megatron's moe_router_pre_softmax False), else the softmax
    over all; GLM-4.5's, glm_routing_options.
    `aux_loss_coef`: model.moe_aux_loss_coef, refused for a dense model; megatron-core's own aux loss stays off
    (policy/load_balancing.py computes it).
    `routing_replay`: the routers take the experts each token is given (policy/routing_replay.py)."""
    if not spec.is_moe:
        if aux_loss_coef is not None:
            raise ConfigError(f"model.moe_aux_loss_coef: {aux_loss_coef}, but {spec.architecture} is a dense model "
                              "(no router to balance); remove it")
        if routing_replay:
            raise ConfigError(f"rollout.routing_replay: {spec.architecture} is a dense model (no router to replay); "
                              "set rollout.routing_replay to false")
        return {}
    return {
        "num_moe_experts": spec.num_experts,
        "moe_router_topk": spec.moe_topk,
        "moe_ffn_hidden_size": spec.moe_ffn_hidden_size,
        "moe_layer_freq": [int(sparse) for sparse in spec.moe_layers],
        "moe_router_pre_softmax": not spec.norm_topk_prob,
        # The load-balancing loss is policy/load_balancing.py's (over real tokens, at a strength of its own)
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": 0.0,
        # The fused router skips routing replay, and both fusions need Transformer Engine.
        "moe_router_fusion": False,
        "moe_permute_fusion": False,
        "moe_enable_routing_replay": routing_replay,
        "moe_shared_expert_intermediate_size": spec.shared_expert_ffn_hidden_size or None,
        "moe_shared_expert_gate": spec.shared_expert_gate,
        **glm_routing_options(spec),
    }


def glm_routing_options(spec: ModelSpec) -> dict:
    """GLM-4.5-style routing (hf_config._glm_moe_fields) in megatron-core's terms. The expert bias is kept as the
    checkpoint has it (update rate 0): megatron-core would move it after every step towards an even load (DeepSeek-V3's
    aux-loss-free balancing in pre-training), which would change which experts the policy chooses outside the loss,
    and the servers would route by another bias than the trainer; with routing replay it chooses nothing in training
    anyway (the routes are given; the probabilities are the sigmoid scores without it)."""
    if spec.router_score != "sigmoid":
        return {}
    return {
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": spec.expert_bias,
        "moe_router_bias_update_rate": 0.0,
        "moe_router_num_groups": spec.moe_groups or None,
        "moe_router_group_topk": spec.moe_group_topk or None,
        "moe_router_topk_scaling_factor": spec.routed_scaling_factor,
    }


def stage_layer_specs(spec: ModelSpec, parallel: ParallelConfig, te: bool, pp_rank: int):
    """The block spec of pipeline stage `pp_rank`: each of its layers dense or with experts as spec.moe_layers
    says. The local spec's core attention is SdpaAttention and its norms policy.rms_norm's (sequence
    parallelism); with Transformer Engine, TE's layers (grouped experts)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_dapo.policy.rms_norm import RMSNorm
    from megatron_dapo.policy.sdpa_attention import SdpaAttention

    def layer(sparse: bool):
        experts = spec.num_experts if sparse else None
        if te:
            return get_gpt_layer_with_transformer_engine_spec(num_experts=experts, moe_grouped_gemm=sparse,
                                                              qk_layernorm=spec.qk_layernorm)
        layer_spec = get_gpt_layer_local_spec(num_experts=experts, qk_layernorm=spec.qk_layernorm,
                                              normalization="RMSNorm")
        layers = layer_spec.submodules
        # The local DotProductAttention materialises [b, heads, s, s] scores; SDPA's kernels do not.
        layers.self_attention.submodules.core_attention = SdpaAttention
        layers.input_layernorm = layers.pre_mlp_layernorm = RMSNorm
        if spec.qk_layernorm:
            layers.self_attention.submodules.q_layernorm = layers.self_attention.submodules.k_layernorm = RMSNorm
        return layer_spec

    per_stage = spec.num_layers // parallel.pipeline_parallel
    sparse = spec.moe_layers or (False,) * spec.num_layers
    kinds = {kind: layer(kind) for kind in set(sparse)}
    mine = sparse[pp_rank * per_stage:(pp_rank + 1) * per_stage]
    final_norm = None
    if te:
        from megatron.core.extensions.transformer_engine import TENorm

        final_norm = TENorm
    return TransformerBlockSubmodules(layer_specs=[kinds[kind] for kind in mine], layer_norm=final_norm or RMSNorm)


def build_model(spec: ModelSpec, parallel: ParallelConfig, *, pre_process: bool, post_process: bool,
                params_dtype: torch.dtype | None = None, initialize: bool = True, activation_recompute: str = "none",
                moe_aux_loss_coef: float | None = None, routing_replay: bool = False):
    """GPTModel for this pipeline stage; logits stay split over the vocabulary (parallel_output).
    `activation_recompute="full"` for a model that is trained (see recompute_options); a frozen or forward-only
    model keeps no activations for a backward, so it has nothing to recompute. `routing_replay`: its routers take
    each token's experts from the batch (policy/routing_replay.py; a mixture of experts only)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(spec, parallel, params_dtype, initialize, activation_recompute, moe_aux_loss_coef,
                                routing_replay)
    te = use_transformer_engine(parallel)
    model = GPTModel(
        config=config,
        transformer_layer_spec=stage_layer_specs(spec, parallel, te,
                                                 parallel_state.get_pipeline_model_parallel_rank()),
        vocab_size=padded_vocab_size(spec.vocab_size, parallel.tensor_parallel),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(spec.rope_theta),
        rotary_percent=spec.rotary_percent,
    )
    if spec.rope_scaling is not None:
        # Llama 3's scaling. GPTModel(rope_scaling=True) fixes low / high frequency factors 1 / 4 and an original
        # length of 8192; the rule it calls (transformers' llama3, ported) takes them as arguments: config.json's.
        rotary = model.rotary_pos_emb
        rotary.inv_freq = rotary._apply_scaling(rotary.inv_freq, **dataclasses.asdict(spec.rope_scaling))
    if config.bf16 and not te:
        # The whole model in bf16, as megatron's own training has it (its Float16Module casts the module): the
        # local spec's norms are torch.nn.RMSNorm built without a dtype, fp32 beside bf16 weights, which
        # megatron-core's checkpointing of a bf16 optimizer cannot map, and which the export would round anyway.
        # (Transformer Engine's layers take params_dtype themselves.)
        model.bfloat16()
    if tensors_on_gpu(parallel):  # what megatron-core builds on the host (norms) goes to the GPU too
        model.cuda(torch.cuda.current_device())
    if routing_replay:
        from megatron_dapo.policy.routing_replay import forget_global_instances

        forget_global_instances()
    return model


def named_weights(model):
    """The model stage's tensors that a checkpoint holds: its parameters, and the routers' expert bias (GLM-4.5's),
    a buffer in megatron-core (no gradient: it moves by its own rule, here not at all: glm_routing_options)."""
    yield from model.named_parameters()
    for name, buffer in model.named_buffers():
        if name.endswith("router.expert_bias"):
            yield name, buffer
