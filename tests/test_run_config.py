"""The run's YAML config: the paper's defaults, overrides, and a clear error naming the key for every bad value."""

from pathlib import Path

import pytest

from megatron_dapo.config import ConfigError
from megatron_dapo.run_config import config_from_dict, load_config

ROOT = Path(__file__).resolve().parent.parent
MINIMAL = {"model": {"path": "m"}, "data": {"train_path": "d.parquet"}}


def test_defaults_are_the_papers():
    cfg = config_from_dict(MINIMAL)
    assert (cfg.loss.eps_low, cfg.loss.eps_high, cfg.loss.kl_coef) == (0.2, 0.28, 0.0)
    assert cfg.algorithm.group_size == 16 and cfg.algorithm.batch_size == 512
    assert (cfg.optim.lr, cfg.optim.warmup_steps) == (1e-6, 20)
    assert (cfg.algorithm.max_response_len, cfg.algorithm.overlong_cache_len) == (20480, 4096)


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "launch" / "configs").glob("*.yaml")))
def test_shipped_configs_load(name):
    load_config(ROOT / "launch" / "configs" / name)


def test_overrides_are_read_as_yaml():
    cfg = config_from_dict(MINIMAL, ["optim.lr=2e-6", "loss.dual_clip_c=3", "rollout.server_urls=[http://a:1]",
                                     "loss.correction.preset=icepop", "train.tensorboard=false"])
    assert cfg.optim.lr == 2e-6 and cfg.loss.dual_clip_c == 3.0 and cfg.rollout.server_urls == ["http://a:1"]
    assert cfg.loss.correction.rule() == {"level": "token", "action": "mask", "lower": 0.5, "upper": 5.0}
    assert cfg.train.tensorboard is False


@pytest.mark.parametrize("override,key", [
    ("loss.eps_hgh=0.3", "loss.eps_hgh: unknown key; did you mean loss.eps_high?"),
    ("trainer.steps=3", "trainer: unknown key"),
    ("loss.eps_low=1.5", "loss.eps_low"),
    ("loss.eps_high=-0.1", "loss.eps_high"),
    # What the fused op refuses is refused here, before a rollout is spent on it.
    ("loss.eps_low=0", "loss.eps_low: must be in \\(0, 1\\)"),
    ("loss.eps_high=0", "loss.eps_high: must be > 0"),
    ("loss.log_ratio_clamp=100", "loss.log_ratio_clamp: must be in \\(0, 80.0\\]"),
    ("loss.dual_clip_c=0.5", "loss.dual_clip_c"),
    ("loss.kl_type=k2", "loss.kl_type"),
    # Issue 52: the rollout correction's rules, by key.
    ("loss.tis_cap=2", "loss.tis_cap: moved to loss.correction \\(tis_cap: C is loss.correction: "
                       "{preset: tis, upper: C}\\)"),
    ("loss.correction.preset=tis_mask", "loss.correction.preset: must be one of 'tis', 'icepop', 'seq_mask', "
                                        "'geo_rs', 'seq_mis' or null, got 'tis_mask'"),
    ("loss.correction.level=tokens", "loss.correction.level: 'tokens' needs loss.correction.action"),
    ("loss.correction={level: tokens, action: mask, upper: 2}", "loss.correction.level: must be one of 'token', "
                                                                "'sequence', 'geometric', got 'tokens'"),
    ("loss.correction={level: token, action: clip, upper: 2}", "loss.correction.action: must be one of"),
    ("loss.correction.upper=2", "loss.correction.upper: is set, but loss.correction.level is not"),
    ("loss.correction={preset: tis, upper: 0.5}", "loss.correction.upper: caps the weight, and must be >= 1"),
    ("loss.correction={preset: tis, upper: .inf}", "loss.correction.upper: must be a finite number, got inf"),
    ("loss.correction={preset: tis, lower: 0.5}", "loss.correction.lower: is for 'mask' and 'reject'"),
    ("loss.correction={preset: icepop, lower: 6}", "loss.correction.lower: must be below upper: [6.0, 5.0] is "
                                                   "out of order"),
    ("loss.correction={preset: icepop, lower: 1.5}", "loss.correction.lower: the band [1.5, 5.0] must hold 1"),
    ("loss.correction={preset: geo_rs, upper: 0.999}", "loss.correction.upper: the band [0.99, 0.999] must hold 1"),
    ("loss.correction={level: sequence, action: reject, upper: 0.9}", "loss.correction.upper: the band [0, 0.9]"),
    ("loss.correction={preset: icepop, lower: -1}", "loss.correction.lower: must be a finite number >= 0"),
    ("loss.old_logprobs=engine", "loss.old_logprobs: must be one of 'recompute', 'rollout'"),
    ("optim.lr=0", "optim.lr"),
    ("optim.lr=fast", "optim.lr: must be float"),
    # Issue 49: these trained to NaN weights (or would have) and exited 0.
    ("optim.lr=.inf", "optim.lr: must be a finite number in \\(0, inf\\), got inf"),
    ("optim.lr=.nan", "optim.lr: must be a finite number"),
    ("optim.lr=1e6", "optim.lr: 1e\\+06 is no learning rate for Adam, which moves each weight .*; did you mean 1e-06?"),
    ("optim.adam_eps=-1", "optim.adam_eps: must be a finite number in \\(0, inf\\), got -1"),
    ("optim.adam_eps=0", "optim.adam_eps"),
    ("optim.weight_decay=-5", "optim.weight_decay: must be a finite number in [0, inf\\), got -5"),
    ("optim.clip_grad=.inf", "optim.clip_grad: must be a finite number"),
    ("optim.adam_beta2=1", "optim.adam_beta2: must be a finite number in [0, 1\\)"),
    ("optim.warmup_steps=-1", "optim.warmup_steps"),
    ("algorithm.group_size=1", "algorithm.group_size"),
    ("algorithm.batch_size=0", "algorithm.batch_size"),
    ("algorithm.oversample_factor=0.5", "algorithm.oversample_factor"),
    ("algorithm.overlong_cache_len=30000", "algorithm.overlong_cache_len"),
    ("rollout.engine=vllm", "rollout.engine"),
    ("rollout.temperature=0", "rollout.temperature"),
    ("rollout.top_p=2", "rollout.top_p"),
    ("rollout.weight_sync=nfs", "rollout.weight_sync"),
    ("rollout.mode=fully_async", "rollout.mode: must be one of 'sync', 'one_step_off', 'async'"),
    ("rollout.max_staleness=0", "rollout.max_staleness: must be a whole number >= 1"),
    ("loss.tis_mode=mask", "loss.tis_mode: moved to loss.correction"),
    ("rollout.server_urls=http://a", "rollout.server_urls: must be a list"),
    # Issue 49: malformed URLs were found only after the policy was built, as a JSONDecodeError or KeyError.
    ("rollout.server_urls=[localhost:30000]", "rollout.server_urls[0]: 'localhost:30000' is not a server's URL"),
    ("rollout.server_urls=[http://a:1, http://b]", "rollout.server_urls[1]: 'http://b' is not a server's URL"),
    ("rollout.server_urls=[http://a:port]", "rollout.server_urls[0]: 'http://a:port' is not a URL"),
    ("rollout.server_urls=[http://a:1/generate]", "rollout.server_urls[0]: .* has a path \\(/generate\\); give the "
                                                  "server's base URL, http://a:1"),
    ("reward.timeout_s=0", "reward.timeout_s"),
    ("reward.num_workers=0", "reward.num_workers"),
    ("reward.max_answers_per_message=0", "reward.max_answers_per_message"),
    ("train.max_bad_steps=0", "train.max_bad_steps"),
    ("parallel.heartbeat_timeout_s=0", "parallel.heartbeat_timeout_s: must be a number > 0"),
    ("rollout.server_health_timeout_s=-1", "rollout.server_health_timeout_s: must be a number > 0"),
    ("rollout.job_timeout_s=0", "rollout.job_timeout_s: must be a number > 0"),
    ("train.checkpoint_timeout_s=0", "train.checkpoint_timeout_s: must be a number > 0"),
    ("parallel.tensor_parallel=0", "parallel.tensor_parallel"),
    ("parallel.device=tpu", "parallel.device"),
    ("parallel.context_parallel=0", "parallel.context_parallel"),
    ("train.steps=0", "train.steps"),
    ("train.keep_last=0", "train.keep_last"),
    ("train.resume=maybe", "train.resume: must be bool"),
    ("model.path=", "model.path"),
    ("train.eval_every=5", "train.eval_every: moved to eval.every"),
    ("eval.samples_per_prompt=0", "eval.samples_per_prompt"),
    ("eval.top_p=0", "eval.top_p"),
    ("eval.max_response_len=0", "eval.max_response_len"),
    ("model.activation_recompute=selective", "model.activation_recompute: must be 'none' or 'full'"),
    ("model.activation_recompute=true", "model.activation_recompute"),
    ("data.train_path=", "data.train_path"),
])
def test_bad_values_name_their_key(override, key):
    with pytest.raises(ConfigError, match=key.replace("?", r"\?").replace("[", r"\[")):
        config_from_dict(MINIMAL, [override])


@pytest.mark.parametrize("overrides,key", [
    (["rollout.engine=local", "parallel.tensor_parallel=2"], "rollout.engine"),
    (["rollout.engine=local", "parallel.context_parallel=2"], "rollout.engine: .* parallel.context_parallel = 1"),
    (["rollout.engine=local", "parallel.expert_parallel=2"], "rollout.engine: 'local' samples on the driver alone, "
                                                             "but parallel.expert_parallel = 2"),
    (["rollout.weight_sync=tensor", "rollout.num_servers=2"], "rollout.weight_sync"),
    (["train.updates_per_step=20", "algorithm.batch_size=2", "algorithm.group_size=4"], "train.updates_per_step"),
    (["rollout.colocate=true", "rollout.engine=local"], "rollout.colocate: .* set rollout.colocate to false"),
    (["rollout.colocate=true", "rollout.weight_sync=distributed"], "rollout.weight_sync: .* take 'tensor'"),
    (["rollout.server_urls=[http://a:1]", "rollout.server_nodes=[n1]"], "rollout.server_nodes: only colocated"),
    (["rollout.colocate=true", "rollout.weight_sync=disk", "rollout.server_urls=[http://a:1]",
      "rollout.server_nodes=[n1, n2]"],
     "rollout.server_nodes: names 2 node"),
    # Sampling beside training: the servers must be free while the trainer trains, and the batch is corrected
    # for the older weights that sampled it.
    (["rollout.mode=one_step_off", "loss.correction.preset=tis", "rollout.engine=local"],
     "rollout.mode: 'one_step_off' .* set rollout.engine to 'sglang'"),
    (["rollout.mode=one_step_off", "loss.correction.preset=tis", "rollout.colocate=true", "rollout.weight_sync=disk"],
     "rollout.mode: 'one_step_off' .* rollout.colocate .* set rollout.colocate to false"),
    (["rollout.mode=one_step_off"], "loss.correction: must be set with rollout.mode 'one_step_off'"),
    (["rollout.mode=async", "loss.correction.preset=tis", "rollout.colocate=true", "rollout.weight_sync=disk"],
     "rollout.mode: 'async' .* rollout.colocate"),
    (["rollout.mode=async"], "loss.correction: must be set with rollout.mode 'async'"),
    # Issue 52: the in-process engine samples with the trained weights and kernels: nothing to correct.
    (["rollout.engine=local", "loss.correction.preset=icepop"],
     "loss.correction: the in-process engine in sync mode .* no mismatch to correct"),
    (["rollout.job_timeout_s=60", "rollout.request_timeout_s=600"],
     "rollout.job_timeout_s: 60 s is shorter than one group's rollout.request_timeout_s"),
    (["rollout.mode=one_step_off", "loss.correction.preset=tis", "rollout.max_staleness=2"],
     "rollout.max_staleness: bounds rollout.mode 'async' only .* set rollout.mode to 'async'"),
    # The engine's log-probs are pi_old's only where it samples with the very weights being trained.
    (["loss.old_logprobs=rollout"],
     "loss.old_logprobs: 'rollout' is exact only for the in-process engine in sync mode .* "
     "rollout.engine 'sglang' samples .* set loss.old_logprobs to 'recompute'"),
    (["loss.old_logprobs=rollout", "rollout.engine=local", "loss.correction.preset=tis"],
     "loss.old_logprobs: 'rollout' .* no mismatch for loss.correction to correct"),
    # A reference refreshed between checkpoints could not be restored by a resume.
    (["loss.kl_coef=0.01", "loss.kl_ref_refresh_steps=4", "train.checkpoint_every=10"],
     "train.checkpoint_every: 10 is not a multiple of loss.kl_ref_refresh_steps 4"),
    (["loss.kl_ref_refresh_steps=4"], "loss.kl_ref_refresh_steps: refreshes .* but loss.kl_coef is 0"),
])
def test_bad_combinations_name_a_key(overrides, key):
    with pytest.raises(ConfigError, match=key):
        config_from_dict(MINIMAL, overrides)


def test_colocated_servers_get_the_memory_saver_on_gpus_only():
    from megatron_dapo.rollout.from_config import server_config

    colocated = ["rollout.colocate=true", "rollout.weight_sync=tensor"]
    gpu = config_from_dict(MINIMAL, colocated)
    assert "--enable-memory-saver" in server_config(gpu).extra_args
    # CPU servers have no memory saver (CUDA only); NCCL's one-rank-per-GPU rule does not bind gloo
    cpu = config_from_dict(MINIMAL, [*colocated[:1], "rollout.server_device=cpu", "rollout.weight_sync=distributed"])
    assert "--enable-memory-saver" not in server_config(cpu).extra_args
    assert "--enable-memory-saver" not in server_config(config_from_dict(MINIMAL)).extra_args


CPU = ["parallel.device=cpu", "rollout.server_device=cpu"]


@pytest.mark.parametrize("overrides, faithful, dtype", [
    ([], "0", "bfloat16"),  # model.dtype auto on GPUs, whatever the checkpoint's torch_dtype
    (["model.dtype=float32"], "0", "float32"),
    (CPU, "0", "float32"),
    (CPU, "1", "bfloat16"),  # device-faithful: what a GPU run builds
    ([*CPU, "model.dtype=float32"], "1", "float32"),
    ([*CPU, "model.dtype=bfloat16"], "0", "bfloat16"),
])
def test_servers_sample_at_the_policys_training_dtype(overrides, faithful, dtype, monkeypatch):
    from megatron_dapo.parallel.device_faithful import ENV
    from megatron_dapo.rollout.from_config import server_config

    monkeypatch.setenv(ENV, faithful)
    assert server_config(config_from_dict(MINIMAL, overrides)).dtype == dtype


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("model: 3\n")
    with pytest.raises(ConfigError, match="model: must be a mapping"):
        load_config(tmp_path / "list.yaml")


def test_training_samples_from_the_distribution_the_trainer_computes_log_probs_of():
    """rollout.top_p < 1 samples from a renormalised nucleus whose log-probs no engine returns, and a temperature
    below 1e-6 decodes greedily: both refused for training, naming the key and why; evaluation has its own."""
    with pytest.raises(ConfigError, match=r"rollout.top_p: must be 1.0 for training, got 0.9: .*renormalised nucleus"
                                          r".*eval.top_p"):
        config_from_dict(MINIMAL, ["rollout.top_p=0.9"])
    with pytest.raises(ConfigError, match=r"rollout.temperature: must be >= 1e-6 for training, got 1e-07: .*greedily"):
        config_from_dict(MINIMAL, ["rollout.temperature=1e-7"])
    cfg = config_from_dict(MINIMAL, ["rollout.temperature=0.7", "rollout.top_p=1.0", "eval.top_p=0.7"])
    assert (cfg.rollout.temperature, cfg.rollout.top_p, cfg.eval.top_p) == (0.7, 1.0, 0.7)


# --- algorithm.preset ---------------------------------------------------------------------------------------

SWITCHES = ("loss.eps_low", "loss.eps_high", "loss.aggregation", "algorithm.overlong_penalty",
            "algorithm.overlong_filter", "algorithm.dynamic_sampling", "loss.kl_coef", "loss.kl_ref_refresh_steps")


def switches(cfg):
    return {key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) for key in SWITCHES}


def test_the_dapo_preset_is_the_default_and_the_grpo_preset_sets_every_switch():
    assert switches(config_from_dict(MINIMAL, ["algorithm.preset=dapo"])) == switches(config_from_dict(MINIMAL))
    assert switches(config_from_dict(MINIMAL, ["algorithm.preset=grpo"])) == {
        "loss.eps_low": 0.2, "loss.eps_high": 0.2, "loss.aggregation": "sample", "algorithm.overlong_penalty": False,
        "algorithm.overlong_filter": False, "algorithm.dynamic_sampling": False, "loss.kl_coef": 0.04,
        "loss.kl_ref_refresh_steps": 0}


def test_a_preset_is_overridden_key_by_key():
    """GRPO with clip-higher, an arm of the ablation; and R1's refreshed reference."""
    cfg = config_from_dict(MINIMAL, ["algorithm.preset=grpo", "loss.eps_high=0.28", "loss.kl_ref_refresh_steps=10"])
    assert (cfg.loss.eps_high, cfg.loss.aggregation, cfg.loss.kl_ref_refresh_steps) == (0.28, "sample", 10)
    cfg = config_from_dict(MINIMAL, ["algorithm.preset=grpo", "algorithm.dynamic_sampling=true",
                                     "algorithm.oversample_factor=2"])  # the switch on, its key with it
    assert cfg.algorithm.dynamic_sampling and cfg.algorithm.oversample_factor == 2.0


@pytest.mark.parametrize("overrides,message", [
    (["algorithm.preset=grpo", "algorithm.oversample_factor=1.5"],
     "algorithm.oversample_factor: draws extra prompts for dynamic sampling, but algorithm.preset 'grpo' sets "
     "algorithm.dynamic_sampling to False .off.; set algorithm.dynamic_sampling as well, or remove "
     "algorithm.oversample_factor"),
    (["algorithm.preset=grpo", "algorithm.overlong_cache_len=8"],
     "algorithm.overlong_cache_len: is the soft overlong penalty's interval, but algorithm.preset 'grpo' sets "
     "algorithm.overlong_penalty to False"),
    (["algorithm.preset=dapo", "loss.kl_type=k1"],
     "loss.kl_type: chooses the KL term's estimator, but algorithm.preset 'dapo' sets loss.kl_coef to 0.0"),
    (["algorithm.preset=dapo", "loss.kl_ref_refresh_steps=10"], "loss.kl_ref_refresh_steps: refreshes"),
    (["algorithm.preset=ppo"], "algorithm.preset: must be one of 'dapo', 'grpo', got 'ppo'"),
])
def test_a_preset_refuses_a_key_it_would_ignore_naming_it(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(MINIMAL, overrides)
