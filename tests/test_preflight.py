"""`megatron-dapo preflight`: every shipped config passes; each check fails naming its key; the CLI's exit codes."""

import inspect
import json
from pathlib import Path

import pytest

from megatron_dapo.cli import main
from megatron_dapo.config import ConfigError
from megatron_dapo.demo.tiny_model import make_tiny_model
from megatron_dapo.preflight import Hardware, preflight
from megatron_dapo.preflight.estimate import model_architecture, model_parameters, stage_parameters, trainer_layout
from megatron_dapo.rollout.from_config import sglang_engine
from megatron_dapo.run_config import config_from_dict, load_config

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "launch" / "configs"
QWEN_7B = CONFIGS / "qwen2.5-7b-dapo-2nodes.yaml"
QWEN_32B = CONFIGS / "qwen2.5-32b-dapo.yaml"


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> Path:
    """A folder with the config.json of the demo's tiny model (make_tiny_model's defaults; no weights needed)."""
    d = {k: p.default for k, p in inspect.signature(make_tiny_model).parameters.items() if p.default is not p.empty}
    folder = tmp_path_factory.mktemp("demo") / "warm"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "hidden_size": d["hidden"], "intermediate_size": 3 * d["hidden"],
        "num_hidden_layers": d["layers"], "num_attention_heads": d["heads"], "num_key_value_heads": d["heads"] // 2,
        "vocab_size": 320, "max_position_embeddings": d["max_positions"], "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True}))
    return folder


def config(path: Path, *overrides: str, demo_model: Path | None = None):
    model = [f"model.path={demo_model}"] if path.name == "tiny-cpu.yaml" else []
    return load_config(path, [*model, *overrides])


# Trainer GPUs of the configs whose trainer is not as large as their servers (preflight's assumption): their header
# says how to check them
TRAINER_GPUS = {"glm-4.5-air-dapo.yaml": 64}


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_shipped_config_passes(name, demo_model):
    report = preflight(config(CONFIGS / name, demo_model=demo_model), Hardware(gpus=TRAINER_GPUS.get(name)))
    report.raise_first_failure()
    text = report.render()
    assert "trainer stage 0" in text and "total" in text and "checks" in text
    assert all(c.ok for c in report.checks)


def test_shipped_architectures_are_the_published_qwen_models():
    seven, _ = model_architecture("checkpoints/Qwen2.5-7B")
    assert model_parameters(seven) == 7_615_616_512  # Qwen2.5-7B's safetensors hold this many
    assert sum(stage_parameters(seven, tp=1, pp=1)) == model_parameters(seven)
    big, _ = model_architecture("anywhere/Qwen2.5-32B")
    assert (big.num_layers, big.num_attention_heads, big.num_query_groups, big.hidden_size) == (64, 40, 8, 5120)
    moe, _ = model_architecture("checkpoints/Qwen3-30B-A3B")  # 30.5B parameters, 3.3B active per token
    experts = sum(stage_parameters(moe, tp=1, pp=1, ep=1, experts=True))
    assert round(model_parameters(moe) / 1e9, 1) == 30.5
    assert 3.3e9 < model_parameters(moe) - experts + experts * moe.moe_topk / moe.num_experts < 3.4e9


@pytest.mark.parametrize("path,overrides,key", [
    (QWEN_7B, ["model.max_tokens_per_micro_batch=16384"], "model.max_tokens_per_micro_batch"),
    (CONFIGS / "tiny-cpu.yaml", ["data.max_prompt_len=100"], "data.max_prompt_len + algorithm.max_response_len"),
    (QWEN_7B, ["rollout.request_timeout_s=600"], "rollout.request_timeout_s"),
    (QWEN_32B, ["parallel.distributed_timeout_minutes=1"], "parallel.distributed_timeout_minutes"),
    (QWEN_32B, ["rollout.weight_sync=disk", "rollout.weight_sync_timeout_s=30"], "rollout.weight_sync_timeout_s"),
])
def test_a_failed_check_names_its_key(path, overrides, key, demo_model):
    report = preflight(config(path, *overrides, demo_model=demo_model))
    assert [c.key for c in report.checks if not c.ok] == [key]
    with pytest.raises(ConfigError, match="^" + key.replace("+", r"\+") + ": .*; (set|raise|lower) "):
        report.raise_first_failure()


def test_a_model_path_without_config_json_or_shipped_architecture_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="model.path: no config.json in .*nowhere.*point model.path"):
        preflight(load_config(QWEN_7B, [f"model.path={tmp_path / 'nowhere'}"]))
    with pytest.raises(ConfigError, match="model.path: .*run `megatron-dapo demo --output .*demo` first"):
        preflight(load_config(CONFIGS / "tiny-cpu.yaml", [f"model.path={tmp_path / 'demo' / 'warm'}"]))


def test_a_mixture_of_experts_counts_its_experts_per_expert_parallel_rank(tmp_path):
    """Each rank holds E / EP experts, whole, whose optimizer state splits over the expert-data-parallel ranks; the
    attention and the rest over TP and DP as for a dense model; the routes' host memory is shown with replay."""
    from test_moe_units import QWEN3_MOE

    from megatron_dapo.preflight.estimate import trainer_layout, trainer_memory

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_MOE))  # 8 experts, top 2, 4 layers all with experts
    spec, _ = model_architecture(str(tmp_path))
    experts = sum(stage_parameters(spec, tp=1, pp=1, ep=1, experts=True))
    assert experts == 4 * 8 * 3 * 32 * 64  # layers x experts x (gate, up, down) of 32 x 64
    padding = 2 * (384 - 300) * 64  # the embedding's and output layer's rows past the vocabulary of 300
    assert sum(stage_parameters(spec, tp=1, pp=1)) + experts - padding == model_parameters(spec)
    assert stage_parameters(spec, tp=2, pp=2, ep=4, experts=True) == [2 * 2 * 3 * 32 * 64] * 2  # 2 layers, 2 each

    def stage0(ep, *extra):
        cfg = load_config(CONFIGS / "tiny-cpu.yaml", [f"model.path={tmp_path}", f"parallel.expert_parallel={ep}",
                                                      "optim.distributed_optimizer=true", *extra])
        return trainer_memory(cfg, spec, trainer_layout(cfg, spec, gpus=4))[0]

    one, four = stage0(1), stage0(4)
    dense = sum(stage_parameters(spec, tp=1, pp=1))
    assert one.grads - four.grads == pytest.approx(4 * (experts - experts / 4))  # fp32 grads of 3/4 of the experts
    # Adam's state: the experts' over the expert-data-parallel ranks (4 at EP1, 1 at EP4), the rest over DP 4
    bytes_per = one.optimizer / (dense / 4 + experts / 4)
    assert four.optimizer == pytest.approx(bytes_per * (dense / 4 + experts / 4 / 1))
    text = preflight(load_config(CONFIGS / "tiny-cpu.yaml", [f"model.path={tmp_path}", "rollout.routing_replay=true",
                                                             "parallel.expert_parallel=1"])).render()
    assert "experts   8 per MoE layer (4 of 4), top 2: 8 per rank" in text and "routes    a batch's routes" in text
    assert "per trainer rank: " in text


def test_the_30b_moe_configs_route_memory_is_counted_per_trainer_rank():
    """Issue 50, finding 5: each rank's share of the batch's routes (uint8 on the host) and a micro-batch's int64 ids
    on the GPU; the routers held every micro-batch's int64 routes on the host before (10-35 GB a rank)."""
    from megatron_dapo.preflight.estimate import rank_route_bytes

    cfg = load_config(CONFIGS / "qwen3-30b-a3b-dapo.yaml")
    spec, _ = model_architecture(cfg.model.path)
    layout = trainer_layout(cfg, spec, None)
    host, gpu = rank_route_bytes(cfg, spec, layout)
    a, m = cfg.algorithm, cfg.model
    longest = cfg.data.max_prompt_len + a.max_response_len
    assert host == a.batch_size * a.group_size // layout.data_parallel * longest * 48 * 8  # uint8: 128 experts
    assert gpu == m.max_tokens_per_micro_batch / cfg.parallel.tensor_parallel * 48 * 8 * 8  # TP2 + SP, PP1
    text = preflight(cfg).render()
    assert f"per trainer rank: {host / 1e9:.1f} GB on the host (its share of the batch), {gpu / 1e6:.1f} MB on the GPU" \
        in text


def test_memory_over_the_gpu_is_a_warning_and_colocated_parts_add_up():
    cfg = load_config(CONFIGS / "qwen2.5-7b-dapo-colocated.yaml",
                      ["rollout.request_timeout_s=90000", "rollout.job_timeout_s=90000"])
    report = preflight(cfg, Hardware(gpu_memory_gb=60))  # a smaller KV cache: a longer worst-case rollout
    assert "warning: colocated: trainer + server needs about" in report.text
    report.raise_first_failure()  # a warning only


def test_activation_recompute_fits_the_32b_config_in_80gb():
    from megatron_dapo.preflight.estimate import activation_bytes, trainer_layout, trainer_memory

    cfg = load_config(QWEN_32B)
    assert cfg.model.activation_recompute == "full"
    report = preflight(cfg)
    assert "warning" not in report.text and "(model.activation_recompute: full: activations are each" in report.text
    spec, _ = model_architecture(cfg.model.path)
    stage0 = trainer_memory(cfg, spec, trainer_layout(cfg, spec, None))[0]
    tokens, in_flight = cfg.model.max_tokens_per_micro_batch, 2  # PP = 2 micro-batches in flight on stage 0
    assert stage0.activations == pytest.approx(2 * spec.hidden_size * tokens * 32 * in_flight  # the layers' inputs
                                               + activation_bytes(spec, 8, 2) * tokens)  # + one layer recomputing
    off = preflight(load_config(QWEN_32B, ["model.activation_recompute=none"])).text
    assert ("warning: trainer stage 0 (32 layers) needs about 128.0 GB per GPU, more than --gpu-memory-gb 80; "
            "with model.activation_recompute: full about 41.0 GB") in off
    assert "model.activation_recompute: full:" not in off


def test_context_parallelism_splits_each_micro_batch_and_the_optimizer_state():
    """At CP = 2 on twice the GPUs (the same DP): a rank holds half of each micro-batch's activations, plus the keys
    and values it gathers from the other half, and half the optimizer state."""
    from megatron_dapo.preflight.estimate import activation_bytes, trainer_layout, trainer_memory

    cfg, with_cp = load_config(QWEN_32B), load_config(QWEN_32B, ["parallel.context_parallel=2"])
    spec, _ = model_architecture(cfg.model.path)
    layout = trainer_layout(cfg, spec, None)
    split = trainer_layout(with_cp, spec, 2 * layout.gpus)
    assert split.data_parallel == layout.data_parallel
    (before, _), (after, _) = trainer_memory(cfg, spec, layout), trainer_memory(with_cp, spec, split)
    assert after.optimizer == pytest.approx(before.optimizer / 2) and after.weights == before.weights
    tokens, in_flight, h = cfg.model.max_tokens_per_micro_batch, 2, spec.hidden_size
    gathered = 2 * 2 * spec.num_query_groups * spec.head_dim / 8 / 2  # bf16 K and V at TP8, the other CP rank's
    assert after.activations == pytest.approx(2 * h * tokens / 2 * 32 * in_flight  # the layers' inputs, half each
                                              + activation_bytes(spec, 8, 2) * tokens / 2 + gathered * tokens)
    assert after.activations < 0.6 * before.activations
    assert f"{2 * layout.gpus} GPUs = TP8 x PP2 x CP2 x DP{layout.data_parallel}" in \
        preflight(with_cp, Hardware(gpus=2 * layout.gpus)).text


def test_a_kl_term_adds_the_reference_policys_weights():
    """A KL term (algorithm.preset grpo keeps one) holds a reference policy: a second copy of each stage's weights."""
    from megatron_dapo.preflight.estimate import trainer_layout, trainer_memory

    def stage0(*overrides):
        cfg = load_config(QWEN_7B, list(overrides))
        spec, _ = model_architecture(cfg.model.path)
        return trainer_memory(cfg, spec, trainer_layout(cfg, spec, None))[0]

    without, with_kl = stage0(), stage0("loss.kl_coef=0.04")
    assert with_kl.weights == 2 * without.weights
    assert (with_kl.grads, with_kl.optimizer) == (without.grads, without.optimizer)


def test_the_gpu_count_sets_data_parallel_and_must_divide():
    assert "16 GPUs = TP4 x PP2 x DP2" in preflight(load_config(QWEN_7B)).text  # as many as the servers use
    assert "32 GPUs = TP4 x PP2 x DP4" in preflight(load_config(QWEN_7B), Hardware(gpus=32)).text
    with pytest.raises(ConfigError, match="^parallel: world size 12"):
        preflight(load_config(QWEN_7B), Hardware(gpus=12))


def test_cli_exit_codes(capsys, demo_model):
    assert main(["preflight", str(QWEN_7B)]) == 0
    out = capsys.readouterr().out
    assert "per GPU, GB" in out and "SGLang server (TP4)" in out and "ok    rollout.request_timeout_s" in out

    assert main(["preflight", str(QWEN_7B), "rollout.request_timeout_s=60", "--gpu-bandwidth-tbs", "2.0"]) == 2
    captured = capsys.readouterr()
    assert "FAIL  rollout.request_timeout_s" in captured.out
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert captured.err.startswith("megatron-dapo preflight: bad config: rollout.request_timeout_s: 60 s is shorter")

    assert main(["preflight", str(CONFIGS / "tiny-cpu.yaml"), f"model.path={demo_model}"]) == 0
    assert "no GPU memory check applies" in capsys.readouterr().out
    assert main(["preflight", str(QWEN_7B), "--gpu-memory-gb", "0"]) == 2
    assert "--gpu-memory-gb: must be > 0" in capsys.readouterr().err


def test_train_refuses_to_start_on_a_failed_check(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert main(["train", str(QWEN_7B), "model.max_tokens_per_micro_batch=16384"]) == 2
    captured = capsys.readouterr()
    assert "16 GPUs = TP4 x PP2 x DP2 (given)" in captured.out  # the world size, printed on rank 0
    assert "megatron-dapo train: bad config: model.max_tokens_per_micro_batch: 16384 tokens" in captured.err


@pytest.mark.parametrize("override,key", [
    ("parallel.distributed_timeout_minutes=0", "parallel.distributed_timeout_minutes"),
    ("rollout.request_timeout_s=0", "rollout.request_timeout_s"),
    ("rollout.weight_sync_timeout_s=-1", "rollout.weight_sync_timeout_s"),
])
def test_timeout_keys_are_validated(override, key):
    with pytest.raises(ConfigError, match=f"^{key}: must be"):
        config_from_dict({"model": {"path": "m"}, "data": {"train_path": "d.jsonl"}}, [override])


def test_the_engine_gets_the_request_timeout(tmp_path):
    cfg = config_from_dict({"model": {"path": "m"}, "data": {"train_path": "d.jsonl"}},
                           ['rollout.server_urls=["http://127.0.0.1:1"]', "rollout.request_timeout_s=1234.0"])
    engine = sglang_engine(cfg, tmp_path)
    assert engine.timeout == 1234.0


def test_the_glm_45_air_config_fits_10_nodes_and_says_why_not_4():
    """Issue 50: GLM-4.5-style routing's launch config (its architecture shipped in launch/models/). Its 64 trainer
    GPUs fit; on 32 (4 nodes, with none left to serve) the trainer alone is over an H100's 80 GB."""
    from megatron_dapo.preflight.estimate import trainer_memory

    cfg = load_config(CONFIGS / "glm-4.5-air-dapo.yaml")
    spec, _ = model_architecture(cfg.model.path)
    assert spec.architecture == "Glm4MoeForCausalLM" and spec.shared_expert_ffn_hidden_size == 1408
    assert spec.moe_layers == (False,) + (True,) * 45 and spec.rotary_percent == 0.5 and spec.expert_bias
    assert round(model_parameters(spec) / 1e9, 2) == 106.85  # without its multi-token prediction layer
    report = preflight(cfg, Hardware(gpus=64))
    assert "warning" not in report.text and "trainer   64 GPUs = TP2 x PP2 x DP16, experts over EP16" in report.text
    four_nodes = trainer_memory(cfg, spec, trainer_layout(cfg, spec, 32))
    assert min(stage.total for stage in four_nodes) > 80e9
