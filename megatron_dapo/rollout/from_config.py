"""The rollout engine a run's `rollout:` section asks for: SGLang servers started here (one per
rollout.num_servers, behind sglang-router when there are several) or attached to by URL."""

from __future__ import annotations

from collections.abc import Callable

from megatron_dapo.config import ConfigError
from megatron_dapo.parallel.runtime import builds_for_gpu
from megatron_dapo.policy.hf_config import model_spec_from_hf
from megatron_dapo.rollout.routes import RouteLayout
from megatron_dapo.rollout.sglang_engine import SGLangEngine
from megatron_dapo.rollout.sglang_server import SGLangServerConfig
from megatron_dapo.run_config import DapoConfig


def server_config(cfg: DapoConfig, *, host: str = "127.0.0.1", port: int | None = None,
                  base_gpu_id: int = 0) -> SGLangServerConfig:
    """One server of the run, wherever it is started (here, or as a SLURM step). It serves at the policy's
    training dtype: it samples with the weights the policy computes with (bf16 on GPUs, and on the CPU in a
    model.dtype bfloat16 run)."""
    rollout = cfg.rollout
    on_cpu = rollout.server_device == "cpu"
    return SGLangServerConfig(cfg.model.path, device=rollout.server_device, host=host, port=port,
                              tensor_parallel=rollout.server_tensor_parallel, base_gpu_id=base_gpu_id,
                              dtype=cfg.model.training_dtype(builds_for_gpu(cfg.parallel)),
                              max_total_tokens=16384 if on_cpu else None,
                              startup_timeout_s=rollout.server_startup_timeout_s,
                              extra_args=list(rollout.server_extra_args)
                              + (["--enable-deterministic-inference"] if rollout.deterministic else [])
                              # GPU memory that /release_memory_occupation can hand back (CUDA only).
                              + (["--enable-memory-saver"] if rollout.colocate and not on_cpu else [])
                              + (["--enable-return-routed-experts"] if rollout.routing_replay else []))


def sglang_engine(cfg: DapoConfig, log_dir, *,
                  on_server_restart: Callable[[str], None] | None = None, wait: bool = True) -> SGLangEngine:
    """With `wait=False` the servers started here may still be starting: `wait_launched()` before sampling."""
    rollout = cfg.rollout
    kwargs = dict(max_in_flight=rollout.max_in_flight, request_timeout_s=rollout.request_timeout_s,
                  max_server_restarts=rollout.max_server_restarts, health_timeout_s=rollout.server_health_timeout_s,
                  on_server_restart=on_server_restart, routes=route_layout(cfg))
    if rollout.server_urls:
        return SGLangEngine(list(rollout.server_urls), **kwargs)
    return SGLangEngine.launch([server_config(cfg)] * rollout.num_servers, log_dir, wait=wait,
                               **kwargs)


def check_served_as_trained(spec) -> None:
    """SGLang 0.5.23 builds every Qwen3-MoE layer with experts (its stage_facts ignores mlp_only_layers and
    decoder_sparse_step): a dense layer's MLP would not load, and the server would sample from another model."""
    dense = [i for i, sparse in enumerate(spec.moe_layers) if not sparse]
    if spec.architecture == "Qwen3MoeForCausalLM" and dense:  # GLM-4.5's dense first layers it builds as such
        raise ConfigError(f"model.path: layers {dense} of this {spec.architecture} are dense (mlp_only_layers / "
                          "decoder_sparse_step), and SGLang serves every Qwen3-MoE layer with experts, so it would "
                          "sample from a different model: use a model with experts in every layer (as Qwen3-30B-A3B "
                          "and Qwen3-235B-A22B have), or rollout.engine: local")


def route_layout(cfg: DapoConfig) -> RouteLayout | None:
    """With rollout.routing_replay, the layout of the routes to ask the servers for (the model's config.json)."""
    if not cfg.rollout.routing_replay:
        return None
    spec = model_spec_from_hf(cfg.model.path)
    if not spec.is_moe:
        raise ConfigError(f"rollout.routing_replay: {spec.architecture} is a dense model (no router to replay); set "
                          "rollout.routing_replay to false")
    return RouteLayout.of(spec)


def server_urls(engine: SGLangEngine) -> list[str]:
    """Where weights go: every server itself (not the router in front of them)."""
    return [s.url for s in engine.servers]
