"""The whole run's configuration: one typed section per concern, read from YAML, validated up front.

Defaults are the DAPO paper's (eps_low 0.2, eps_high 0.28, G = 16, lr 1e-6 with 20 warmup steps,
L_max 20480 with L_cache 4096, no KL). `load_config(path, overrides)` reads YAML, applies
`section.key=value` overrides, resolves `algorithm.preset` (algorithm/presets.py), and refuses unknown keys (naming the closest known one), values of
the wrong type, and values or combinations that cannot work, each with the key in the message.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megatron_dapo.algorithm.config import AlgorithmConfig
from megatron_dapo.algorithm.presets import apply_preset
from megatron_dapo.config import (
    ConfigError,
    DataConfig,
    EvalConfig,
    LossConfig,
    MetricsConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RolloutConfig,
    TrainConfig,
)
from megatron_dapo.reward.config import RewardConfig
from megatron_dapo.user_files import read_yaml


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


@dataclass(frozen=True)
class DapoConfig:
    model: ModelConfig
    data: DataConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self):
        p, r = self.parallel, self.rollout
        if r.engine == "local":
            _require(p.tensor_parallel == 1 and p.pipeline_parallel == 1 and p.context_parallel == 1, "rollout.engine",
                     "'local' samples from the policy in-process and needs parallel.tensor_parallel = "
                     "parallel.pipeline_parallel = parallel.context_parallel = 1; use 'sglang' for split models")
            # Issue 50: the driver's forward waited in the experts' all-to-all for ranks that were not sampling.
            _require(p.expert_parallel == 1, "rollout.engine",
                     f"'local' samples on the driver alone, but parallel.expert_parallel = {p.expert_parallel} deals "
                     "the experts over ranks whose all-to-all every forward needs; use 'sglang', or "
                     "parallel.expert_parallel = 1")
        if r.engine == "sglang" and r.weight_sync == "tensor":
            _require(r.server_tensor_parallel == 1 and r.num_servers == 1, "rollout.weight_sync",
                     "'tensor' (colocated) pushes to one server at TP 1; use 'distributed' or 'disk'")
        correction = self.loss.correction
        _require(r.mode == "sync" or correction.enabled, "loss.correction",
                 f"must be set with rollout.mode {r.mode!r}: its batches were sampled by older weights, and the loss "
                 "must weigh the engine's samples over to pi_old (decoupled PPO); set loss.correction.preset "
                 "('tis' is the common one), or rollout.mode to 'sync'")
        _require(not (correction.enabled and r.mode == "sync" and r.engine == "local"), "loss.correction",
                 "the in-process engine in sync mode samples with the very weights and kernels being trained, so "
                 "there is no mismatch to correct; remove loss.correction, or use rollout.engine 'sglang'")
        _require(self.loss.old_logprobs == "recompute" or r.engine == "local", "loss.old_logprobs",
                 f"'rollout' is exact only for the in-process engine in sync mode (it samples with the very weights "
                 f"being trained); rollout.engine {r.engine!r} samples with its own copy and kernels: set "
                 "loss.old_logprobs to 'recompute'")
        refresh = self.loss.kl_ref_refresh_steps
        _require(not refresh or self.train.checkpoint_every % refresh == 0, "train.checkpoint_every",
                 f"{self.train.checkpoint_every} is not a multiple of loss.kl_ref_refresh_steps {refresh}: a run resumed "
                 "between two refreshes of the KL reference could not restore it (it is not saved); use a multiple, "
                 "or 0 (a checkpoint at the end only)")
        _require(self.train.updates_per_step <= self.algorithm.batch_size * self.algorithm.group_size,
                 "train.updates_per_step", f"{self.train.updates_per_step} mini-batches cannot be cut from "
                 f"{self.algorithm.batch_size} x {self.algorithm.group_size} responses")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _coerce(value, annotation, key: str):
    """Check a YAML value against a field's type; ints are accepted where floats are expected."""
    hint = annotation
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        hint = next(o for o in options if o is not type(None))
    if typing.get_origin(hint) is list:
        _require(isinstance(value, list), key, f"must be a list, got {value!r}")
        (item,) = typing.get_args(hint)
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if hint is float and isinstance(value, str):
        try:  # YAML 1.1 reads "1e-6" (no dot) as a string
            value = float(value)
        except ValueError:
            pass
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = isinstance(value, hint) and not (hint in (int, float) and isinstance(value, bool))
    _require(ok, key, f"must be {hint.__name__}, got {value!r} ({type(value).__name__})")
    return value


# Keys that moved: named in the error, not just refused.
MOVED_KEYS = {"train.eval_every": "eval.every", "train.eval_samples_per_prompt": "eval.samples_per_prompt",
              "train.eval_max_prompts": "eval.max_prompts",
              "loss.tis_cap": "loss.correction (tis_cap: C is loss.correction: {preset: tis, upper: C})",
              "loss.tis_mode": "loss.correction (tis_mode: mask is loss.correction: {level: token, action: mask, "
                               "upper: C})"}


def _build(cls, data, prefix: str):
    _require(isinstance(data, dict), prefix.rstrip(".") or "config",
             f"must be a mapping of keys to values, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in names:
            _require(full not in MOVED_KEYS, full, f"moved to {MOVED_KEYS.get(full)}; write it there")
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"did you mean {prefix}{close[0]}?" if close else f"known keys: {', '.join(names)}"
            raise ConfigError(f"{full}: unknown key; {hint}")
        is_section = dataclasses.is_dataclass(hints[key])
        kwargs[key] = _build(hints[key], value, f"{full}.") if is_section else _coerce(value, hints[key], full)
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and f.name not in kwargs:
            kwargs[f.name] = _build(hints[f.name], {}, f"{prefix}{f.name}.")
    return cls(**kwargs)


def apply_override(data: dict, override: str) -> None:
    """`a.b=value`: the value is read as YAML (numbers, booleans, lists, null)."""
    _require("=" in override, override, "an override must look like section.key=value")
    key, raw = override.split("=", 1)
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        _require(isinstance(node, dict), key, "cannot set a key inside a value that is not a section")
    node[parts[-1]] = yaml.safe_load(raw)


def config_from_dict(data: dict, overrides: typing.Sequence[str] = ()) -> DapoConfig:
    data = copy.deepcopy(data or {})  # overrides must not change the caller's dict
    for override in overrides:
        apply_override(data, override)
    apply_preset(data)
    return _build(DapoConfig, data, "")


def load_config(path, overrides: typing.Sequence[str] = ()) -> DapoConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    return config_from_dict(read_yaml(path, error=ConfigError), overrides)
