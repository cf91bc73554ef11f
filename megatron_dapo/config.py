"""Typed configuration sections, validated up front: every error names the bad key and says how to fix it.

The whole run (`megatron_dapo.run_config.DapoConfig`) is assembled from these and from the sections
owned by the algorithm and reward packages, with the DAPO paper's defaults.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import urllib.parse
from dataclasses import dataclass, field

from megatron_dapo.errors import DapoError
from megatron_dapo.ops.loss_settings import (
    CORRECTION_PRESETS,
    DapoLossParamError,
    check_aggregation,
    check_correction_params,
    check_dapo_loss_params,
)


log = logging.getLogger(__name__)


class ConfigError(DapoError, ValueError):
    """A configuration value that cannot work; the message names the key."""


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


def _whole(value, key: str, minimum: int) -> None:
    _require(isinstance(value, int) and not isinstance(value, bool) and value >= minimum, key,
             f"must be a whole number >= {minimum}, got {value!r}")


def _positive(value, key: str) -> None:
    _require(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0, key,
             f"must be a number > 0, got {value!r}")


def _finite(value, key: str, low: float, high: float = math.inf, *, low_open: bool = False,
            high_open: bool = True) -> None:
    """A finite number in [low, high] (an open end excludes it): inf and NaN name the key too, rather than train
    to NaN weights."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    inside = number and (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    span = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    _require(inside, key, f"must be a finite number in {span}, got {value!r}")


@dataclass(frozen=True)
class ParallelConfig:
    """How the policy is split: tensor x pipeline x context x data parallel (data = world / the rest); a mixture
    of experts' experts are dealt over `expert_parallel` ranks, which split the tensor x data-parallel ranks of a
    pipeline stage (each expert whole on its rank: megatron-core's expert tensor parallelism stays 1)."""

    tensor_parallel: int = 1  # ranks each layer's weights and attention heads are split over (Megatron's TP)
    pipeline_parallel: int = 1  # stages the layers are split into, one after the other (Megatron's PP)
    # Each sequence cut over this many ranks (policy/context_parallel.py): for sequences longer than one GPU holds.
    context_parallel: int = 1
    expert_parallel: int = 1  # ranks a mixture of experts' experts are dealt over (Megatron's EP); must divide them
    # Megatron's sequence parallelism: the activations outside attention and the MLP (norms, residuals, the
    # experts' dispatch) split along the sequence over the tensor-parallel ranks, instead of a full copy on each.
    # Needs tensor_parallel > 1; a mixture of experts with tensor_parallel > 1 needs it.
    sequence_parallel: bool = False
    device: str = "cuda"  # "cuda" (NCCL) or "cpu" (gloo)
    seed: int = 1234  # the model's random state (megatron-core's RNG tracker, dropout): each rank's from it
    # Minutes a rank may wait inside one NCCL / gloo collective before the job fails: it must outlast what
    # global rank 0 does alone meanwhile (a checkpoint write, the disk weight sync); `megatron-dapo preflight`
    # estimates that.
    distributed_timeout_minutes: int = 30
    # Seconds a trainer rank may go without beating (parallel/rank_heartbeat.py: a thread of its own, whatever its main
    # thread waits on) before the job ends, naming it as stuck.
    heartbeat_timeout_s: float = 300.0

    def __post_init__(self):
        for key in ("tensor_parallel", "pipeline_parallel", "context_parallel", "expert_parallel",
                    "distributed_timeout_minutes"):
            _whole(getattr(self, key), f"parallel.{key}", 1)
        _positive(self.heartbeat_timeout_s, "parallel.heartbeat_timeout_s")
        _require(self.device in ("cuda", "cpu"), "parallel.device", f"must be 'cuda' or 'cpu', got {self.device!r}")
        _require(isinstance(self.sequence_parallel, bool), "parallel.sequence_parallel",
                 f"must be true or false, got {self.sequence_parallel!r}")
        _require(not self.sequence_parallel or self.tensor_parallel > 1, "parallel.sequence_parallel",
                 "splits activations over the tensor-parallel ranks, but parallel.tensor_parallel is 1; set "
                 "parallel.sequence_parallel to false, or parallel.tensor_parallel > 1")

    @property
    def model_parallel(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel

    def data_parallel(self, world_size: int) -> int:
        _require(world_size % self.model_parallel == 0, "parallel",
                 f"world size {world_size} is not divisible by tensor_parallel x pipeline_parallel x "
                 f"context_parallel = {self.model_parallel}; change the sizes or the number of processes")
        data = world_size // self.model_parallel
        # megatron-core deals the experts over the ranks of a stage: expert_parallel x expert data parallel
        _require((self.tensor_parallel * self.context_parallel * data) % self.expert_parallel == 0,
                 "parallel.expert_parallel",
                 f"{self.expert_parallel} does not divide the {self.tensor_parallel * self.context_parallel * data} "
                 f"ranks of a pipeline stage (tensor_parallel x context_parallel x data parallel, world size "
                 f"{world_size}); choose a divisor of it, or change the number of processes")
        return data


MAX_LR = 1.0  # optim.lr's bound, exclusive, unless adam_eps >= lr
HIGH_LR = 1e-3  # above it optim.lr is warned of: tiny demo models train at 2e-4, RL fine-tuning of LLMs at ~1e-6


@dataclass(frozen=True)
class OptimConfig:
    """Adam (megatron-core's optimizer) with gradient clipping and a linear warmup, then a constant rate."""

    # The learning rate after warmup: finite and > 0, below 1 unless adam_eps >= lr; warned of above 1e-3
    lr: float = 1e-6
    # Linear warmup over this many *rollout* steps (the paper's 20), of train.updates_per_step updates each.
    warmup_steps: int = 20
    weight_decay: float = 0.1  # decoupled (AdamW); biases and norms are left out of it
    adam_beta1: float = 0.9  # Adam's decay of the gradient's running mean
    adam_beta2: float = 0.999  # Adam's decay of the squared gradient's running mean
    adam_eps: float = 1e-8  # added to the second moment's root; > 0
    clip_grad: float = 1.0  # the gradient's global norm is clipped to this; 0: no clipping
    # The optimizer's state (fp32 master weights, Adam's moments) split over the data-parallel ranks (megatron-core's
    # distributed optimizer) instead of a full copy on each; a checkpoint resumes only with the same setting.
    distributed_optimizer: bool = True

    def __post_init__(self):
        _finite(self.lr, "optim.lr", 0, low_open=True)
        _finite(self.adam_eps, "optim.adam_eps", 0, low_open=True)
        # Adam moves each weight by up to about lr per update (while adam_eps is small beside the gradients): at
        # lr >= 1 weights of size ~0.02 are destroyed at once, and such a value is a typo (1e6 for 1e-6). With
        # adam_eps >= lr the update is a plain gradient step of lr / adam_eps at most, which is what it means.
        if self.lr >= MAX_LR and self.adam_eps < self.lr:
            guess = f"; did you mean {1 / self.lr:g}?" if self.lr > 1 else ""
            raise ConfigError(f"optim.lr: {self.lr:g} is no learning rate for Adam, which moves each weight by up to "
                              f"about lr per update (RL fine-tuning uses 1e-7 to 1e-5){guess}")
        if self.lr > HIGH_LR:
            log.warning("optim.lr = %g is far above what RL fine-tuning uses (1e-7 to 1e-5; DAPO's 1e-6): a large "
                        "model's first updates may wreck it", self.lr)
        _whole(self.warmup_steps, "optim.warmup_steps", 0)
        _finite(self.clip_grad, "optim.clip_grad", 0)  # 0 turns clipping off
        _finite(self.weight_decay, "optim.weight_decay", 0)
        _finite(self.adam_beta1, "optim.adam_beta1", 0, 1)
        _finite(self.adam_beta2, "optim.adam_beta2", 0, 1)

    def lr_at(self, update: int, updates_per_step: int = 1) -> float:
        """Linear warmup over warmup_steps rollout steps of `updates_per_step` optimizer updates each, then
        constant; `update` counts optimizer updates from 0 (rollout step s starts at s * updates_per_step)."""
        if not self.warmup_steps:
            return self.lr
        return self.lr * min(1.0, (update + 1) / (self.warmup_steps * updates_per_step))


OLD_LOGPROB_SOURCES = ("recompute", "rollout")


@dataclass(frozen=True)
class CorrectionConfig:
    """loss.correction: the rollout correction, a weight per loss token for the engine's mismatch with the trainer
    and for the older weights a one_step_off / async batch was sampled by (ops/rollout_correction.py has the
    equations). Off unless a preset or a level is set."""

    # A recipe by name, filling level, action, lower and upper where they are unset (one that is set overrides it):
    # "tis" token truncate at 2 (truncated IS); "icepop" token mask [0.5, 5]; "seq_mask" sequence mask at 3 (TRL's
    # default); "geo_rs" geometric reject [0.99, 1.01] (SkyRL's first choice); "seq_mis" sequence mask at 2 (masked
    # IS). null: none.
    preset: str | None = None
    # What a token's ratio is: "token", its own pi_old / pi_rollout; "sequence", its response's, exp of the sum of
    # the log-ratios (unbiased; shrinks long responses' weights: exp(L x the mean log-ratio)); "geometric", exp of
    # their mean (length-free). null: no correction.
    level: str | None = None
    # What the ratio does to the token's term: "truncate", weighted min(ratio, upper); "mask", weighted ratio inside
    # [lower, upper] and 0 outside; "reject", weighted 1 inside and 0 outside. A weight of 0 keeps the token in the
    # normaliser.
    action: str | None = None
    lower: float | None = None  # mask / reject: the band's lower end (null: none); truncate has none
    upper: float | None = None  # truncate: the cap (>= 1); mask / reject: the band's upper end

    def __post_init__(self):
        if self.preset is not None:
            _require(self.preset in CORRECTION_PRESETS, "loss.correction.preset",
                     f"must be one of {', '.join(map(repr, CORRECTION_PRESETS))} or null, got {self.preset!r}")
            level, action, lower, upper = CORRECTION_PRESETS[self.preset]
            for name, value in (("level", level), ("action", action), ("upper", upper)):
                if getattr(self, name) is None:
                    object.__setattr__(self, name, value)  # resolved here, so the saved config says what ran
            if self.lower is None and self.action != "truncate":  # a band's end; truncate has none
                object.__setattr__(self, "lower", lower)
        if self.level is None:
            for name in ("action", "lower", "upper"):
                _require(getattr(self, name) is None, f"loss.correction.{name}",
                         "is set, but loss.correction.level is not (no correction): set loss.correction.preset or "
                         f"loss.correction.level, or remove loss.correction.{name}")
            return
        _require(self.action is not None and self.upper is not None, "loss.correction.level",
                 f"{self.level!r} needs loss.correction.action and loss.correction.upper too (or a "
                 "loss.correction.preset to fill them)")
        try:
            check_correction_params(level=self.level, action=self.action, lower=self.lower, upper=self.upper)
        except DapoLossParamError as e:
            raise ConfigError(f"loss.correction.{e.param}: {e.message}") from None

    @property
    def enabled(self) -> bool:
        return self.level is not None

    def rule(self) -> dict:
        """The op's arguments (ops/rollout_correction.correction_weights)."""
        return {"level": self.level, "action": self.action, "lower": self.lower, "upper": self.upper}


@dataclass(frozen=True)
class LossConfig:
    """The clipped token-level objective, and the optional extras DAPO leaves off by default."""

    eps_low: float = 0.2  # the ratio's lower clip, 1 - eps_low (DAPO's clip-higher keeps it at PPO's)
    eps_high: float = 0.28  # the ratio's upper clip, 1 + eps_high (DAPO's clip-higher raises it)
    # Dual clip (> 1): for negative advantages the token's loss is at most c x |advantage|; null: off (DAPO's).
    dual_clip_c: float | None = None
    log_ratio_clamp: float = 20.0  # log(pi / pi_old) clamped to +-this before exp, so the ratio stays finite
    kl_coef: float = 0.0  # > 0: a KL penalty against a reference policy (DAPO drops it; GRPO keeps it)
    kl_type: str = "k3"  # the KL estimator: "k3" (Schulman's, >= 0, unbiased) or "k1" (the log ratio)
    # The KL term's reference: 0, the initial policy, frozen; N > 0, the policy as it is after every N-th rollout
    # step (DeepSeek-R1's GRPO). Needs loss.kl_coef > 0.
    kl_ref_refresh_steps: int = 0
    # How the step's token terms are averaged (ops/loss_aggregation.py): "token" (DAPO), every loss token of the
    # step weighs the same; "sample" (GRPO), each response's mean over its tokens, then the mean over responses.
    aggregation: str = "token"
    # The rollout correction (a nested section): weights for the engine's mismatch and a stale batch's older weights.
    # They multiply the KL term too (loss.kl_coef > 0): that term is a mean of a per-token estimate over the tokens
    # the engine sampled, and the weights move it from the engine's distribution to pi_old's, as they do the
    # policy-gradient term.
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    # Where pi_old's log-probs come from. "recompute": a forward-only pass of the current weights over the batch
    # (the paper's way; it also measures the engine's mismatch). "rollout": the engine's own, returned as it
    # sampled; exact only where the engine is the trained policy itself at these weights (the in-process engine
    # in sync mode), where it saves that pass; refused elsewhere.
    old_logprobs: str = "recompute"

    def __post_init__(self):
        try:  # the op's own rules: a config the op would refuse is refused before anything starts
            check_dapo_loss_params(eps_low=self.eps_low, eps_high=self.eps_high, dual_clip_c=self.dual_clip_c,
                                   log_ratio_clamp=self.log_ratio_clamp, kl_coef=self.kl_coef, kl_type=self.kl_type)
        except DapoLossParamError as e:
            raise ConfigError(f"loss.{e.param}: {e.message}") from None
        try:
            check_aggregation(self.aggregation)
        except ValueError as e:
            raise ConfigError(f"loss.aggregation: {e}") from None
        _whole(self.kl_ref_refresh_steps, "loss.kl_ref_refresh_steps", 0)
        _require(not self.kl_ref_refresh_steps or self.kl_coef > 0, "loss.kl_ref_refresh_steps",
                 f"refreshes the KL term's reference every {self.kl_ref_refresh_steps} steps, but loss.kl_coef is 0 "
                 "(no KL term); set loss.kl_coef > 0, or loss.kl_ref_refresh_steps to 0")
        _require(self.old_logprobs in OLD_LOGPROB_SOURCES, "loss.old_logprobs",
                 f"must be one of {', '.join(map(repr, OLD_LOGPROB_SOURCES))}, got {self.old_logprobs!r}")
        _require(self.old_logprobs == "recompute" or not self.correction.enabled, "loss.old_logprobs",
                 "'rollout' takes pi_old to be the engine's own distribution, so there is no mismatch for "
                 "loss.correction to correct (and no recomputed pi_old to take a ratio against); set "
                 "loss.old_logprobs to 'recompute', or remove loss.correction")


ACTIVATION_RECOMPUTE = ("none", "full")
TRAINING_DTYPES = ("auto", "bfloat16", "float32")


def default_training_dtype(gpu: bool) -> str:
    """model.dtype "auto" for a run that builds what a GPU runs (`gpu`: on GPUs, or device-faithful on the CPU)
    or not: the one definition of the default precision."""
    return "bfloat16" if gpu else "float32"


@dataclass(frozen=True)
class ModelConfig:
    path: str = ""  # Hugging Face folder: config.json, weights, tokenizer
    # Tokens per micro-batch: packed, the real tokens of its sequences; padded, rows x the longest row.
    max_tokens_per_micro_batch: int = 8192
    # true: each micro-batch holds whole sequences end to end, attending within each (no padding computed);
    # false: right-padded [rows, length] blocks of similar lengths (policy/batch.py).
    packing: bool = False
    # "full": each transformer layer of the trained policy keeps only its input for the backward and recomputes
    # its other activations there (megatron-core's full recompute, one layer at a time): it trades about a third
    # more compute per training step for a fraction of the activation memory. "none": keep all activations.
    activation_recompute: str = "none"
    # The dtype the policy trains in (its parameters and activations; with bfloat16 the optimizer keeps an fp32
    # master copy of the weights and accumulates gradients in fp32). "auto": bfloat16 on GPUs and in device-faithful
    # CPU runs (the tests), float32 on the CPU otherwise. bfloat16 on the CPU runs the GPU's precision path there
    # (megatron-core's bf16 optimizer over gloo).
    dtype: str = "auto"
    # A mixture of experts' load-balancing loss coefficient (the switch loss per MoE layer and micro-batch over its
    # real tokens, averaged over the micro-batches by their real tokens: policy/load_balancing.py); null: the
    # model's config.json's router_aux_loss_coef. 0 turns it off.
    moe_aux_loss_coef: float | None = None

    def __post_init__(self):
        _require(self.moe_aux_loss_coef is None or (isinstance(self.moe_aux_loss_coef, (int, float))
                                                    and not isinstance(self.moe_aux_loss_coef, bool)
                                                    and self.moe_aux_loss_coef >= 0),
                 "model.moe_aux_loss_coef", f"must be a number >= 0 or null, got {self.moe_aux_loss_coef!r}")
        _require(bool(self.path), "model.path", "must name a Hugging Face model folder (config.json + weights + "
                 "tokenizer); convert other checkpoints with `megatron-dapo convert`")
        _whole(self.max_tokens_per_micro_batch, "model.max_tokens_per_micro_batch", 1)
        _require(isinstance(self.packing, bool), "model.packing", f"must be true or false, got {self.packing!r}")
        _require(self.activation_recompute in ACTIVATION_RECOMPUTE, "model.activation_recompute",
                 f"must be 'none' or 'full', got {self.activation_recompute!r}")
        _require(self.dtype in TRAINING_DTYPES, "model.dtype",
                 f"must be one of {', '.join(TRAINING_DTYPES)}, got {self.dtype!r} (float16 would need loss scaling, "
                 "which the trainer does not do: use bfloat16)")

    def training_dtype(self, gpu: bool) -> str:
        """model.dtype in a run that builds what a GPU runs (`gpu`) or not: "bfloat16" or "float32"."""
        return self.dtype if self.dtype != "auto" else default_training_dtype(gpu)


@dataclass(frozen=True)
class DataConfig:
    train_path: str = ""  # parquet (DAPO-Math-17K schema) or .jsonl with the same fields
    eval_path: str | None = None  # held-out prompts in the same format (eval section); null: no evaluation
    chat_template: bool = True  # False: the prompt's text as is (for tokenizers without a chat template)
    max_prompt_len: int = 2048  # tokens; longer prompts are left out and counted (prompts_too_long)
    seed: int = 42  # the order the prompts are drawn in (each epoch shuffled from it)
    # Train on each (prompt, ground truth) once per epoch: DAPO-Math-17K's parquet holds every problem
    # about 100 times. Off: the file's rows as they are.
    drop_duplicates: bool = False

    def __post_init__(self):
        _require(bool(self.train_path), "data.train_path", "must name a .parquet or .jsonl file of prompts")
        _whole(self.max_prompt_len, "data.max_prompt_len", 1)


ROLLOUT_MODES = ("sync", "one_step_off", "async")


@dataclass(frozen=True)
class RolloutConfig:
    engine: str = "sglang"  # "sglang" (servers) or "local" (the policy in-process: TP = PP = 1, for demos)
    # "sync": each step samples its batch from the weights it trains (on-policy). "one_step_off": the next
    # step's batch is sampled while this one trains, so each batch is one weight version old (servers and
    # trainer both busy); the weights reach the servers at the step boundary, once that batch is done.
    # "async": the servers sample the next max_staleness steps' batches back to back, and each step's new
    # weights are pushed into them while they sample (partial rollouts: a response's later tokens come
    # from the newer weights).
    mode: str = "sync"
    # rollout.mode async: the batch a step trains on was started by weights at most this many steps older
    # than the trainer's (a response's oldest token counts); groups older than that are dropped and counted.
    max_staleness: int = 1
    temperature: float = 1.0  # sampling temperature; the trainer's log-probs are computed at the same one
    top_p: float = 1.0  # nucleus sampling; 1: the whole distribution (the paper's for training)
    server_urls: list[str] = field(default_factory=list)  # attach to running servers; empty: start them
    num_servers: int = 1  # SGLang servers the run (or the SLURM launcher) starts
    server_tensor_parallel: int = 1  # GPUs per server (SGLang's --tp)
    server_device: str = "cuda"  # "cuda", or "cpu" (SGLang's CPU backend: the tests and tiny runs)
    # More SGLang flags, e.g. ["--mem-fraction-static", "0.5"]
    server_extra_args: list[str] = field(default_factory=list)
    server_startup_timeout_s: float = 600.0  # seconds a started server may take to answer /health
    # Servers sample bitwise reproducibly per (request, seed), whatever else is batched, so a resumed run
    # repeats the interrupted one (SGLang's --enable-deterministic-inference; slower).
    deterministic: bool = False
    # A mixture of experts: the engine returns the experts its routers chose for every token, and the trainer's
    # routers take them in the old-log-prob recompute and in training (policy/routing_replay.py). A dense model
    # refuses it.
    routing_replay: bool = False
    max_in_flight: int = 64  # groups sent to the servers at once (their queues hold the rest)
    # Seconds one /generate call (a group) may take, including its wait in the SGLang server's queue behind
    # the other groups in flight; `megatron-dapo preflight` estimates the worst case.
    request_timeout_s: float = 600.0
    max_server_restarts: int = 3  # times a server the run started is restarted after it dies, before the run fails
    # Seconds one job of the rollout service may run (a step's batch with all its rounds of dynamic sampling,
    # server restarts included; an evaluation) before the run fails, naming it.
    job_timeout_s: float = 10800.0
    # Seconds a server with calls in flight may leave /health unanswered before it counts as stuck (stopped, its
    # machine hung): its calls fail at once, it is restarted and its groups are sent again.
    server_health_timeout_s: float = 60.0
    weight_sync: str = "distributed"  # "distributed" (NCCL/gloo), "tensor" (colocated), "disk"
    weight_sync_bucket_mb: int = 512  # the weights go to the servers in buckets of about this size
    # Seconds one HTTP call of the weight sync or of the servers' memory release / resume may take (the
    # slowest: a server loading the whole model from disk).
    weight_sync_timeout_s: float = 600.0
    # The servers share the trainer's nodes and accelerators: they release their memory while the trainer
    # trains and take it back around the weight sync (SGLang's memory saver on GPUs).
    colocate: bool = False
    # Colocated on several nodes: the node each of server_urls runs on (its SLURM node name, else its host
    # name), so that each node's first trainer rank pushes the weights to the servers beside it. Empty: all
    # on global rank 0's node. The SLURM launcher fills it.
    server_nodes: list[str] = field(default_factory=list)

    def __post_init__(self):
        _require(self.engine in ("sglang", "local"), "rollout.engine",
                 f"must be 'sglang' or 'local', got {self.engine!r}")
        _require(self.mode in ROLLOUT_MODES, "rollout.mode",
                 f"must be one of {', '.join(map(repr, ROLLOUT_MODES))}, got {self.mode!r}")
        if self.mode != "sync":
            _require(self.engine == "sglang", "rollout.mode",
                     f"{self.mode!r} samples beside training, but rollout.engine 'local' samples with the policy "
                     "being trained; set rollout.engine to 'sglang', or rollout.mode to 'sync'")
            _require(not self.colocate, "rollout.mode",
                     f"{self.mode!r} keeps the servers sampling while the trainer trains, but rollout.colocate "
                     "gives the servers' accelerators to the trainer while it trains; set rollout.colocate to "
                     "false (servers on nodes of their own), or rollout.mode to 'sync'")
        _whole(self.max_staleness, "rollout.max_staleness", 1)
        _require(self.mode == "async" or self.max_staleness == 1, "rollout.max_staleness",
                 f"bounds rollout.mode 'async' only (one_step_off is one step stale by design); got "
                 f"{self.max_staleness} with mode {self.mode!r}: set rollout.mode to 'async', or remove it")
        _positive(self.temperature, "rollout.temperature")
        # The trainer's log-probs are those of softmax(logits / temperature) over the whole vocabulary, what the
        # engines return for a sampled token; two settings would sample from another distribution.
        _require(self.temperature >= 1e-6, "rollout.temperature",
                 f"must be >= 1e-6 for training, got {self.temperature}: below it the engines decode greedily (every "
                 "response of a group the same, so dynamic sampling keeps no group) and return temperature-1 "
                 "log-probs, not the trainer's")
        _require(0 < self.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {self.top_p}")
        _require(self.top_p == 1, "rollout.top_p",
                 f"must be 1.0 for training, got {self.top_p}: with top_p < 1 the engine samples from the "
                 "renormalised nucleus, while SGLang returns (and the trainer recomputes) log-probs of the whole "
                 "softmax(logits / rollout.temperature), so the PPO ratio, the truncated-IS weights and the mismatch "
                 "metrics would describe a distribution other than the one sampled from; set rollout.top_p to 1.0 "
                 "(evaluation samples at eval.top_p, which may be anything)")
        _require(isinstance(self.routing_replay, bool), "rollout.routing_replay",
                 f"must be true or false, got {self.routing_replay!r}")
        _whole(self.num_servers, "rollout.num_servers", 1)
        _whole(self.server_tensor_parallel, "rollout.server_tensor_parallel", 1)
        _require(self.server_device in ("cuda", "cpu"), "rollout.server_device",
                 f"must be 'cuda' or 'cpu', got {self.server_device!r}")
        _whole(self.max_in_flight, "rollout.max_in_flight", 1)
        _positive(self.request_timeout_s, "rollout.request_timeout_s")
        _positive(self.weight_sync_timeout_s, "rollout.weight_sync_timeout_s")
        _whole(self.max_server_restarts, "rollout.max_server_restarts", 0)
        _positive(self.server_health_timeout_s, "rollout.server_health_timeout_s")
        _positive(self.job_timeout_s, "rollout.job_timeout_s")
        _require(self.job_timeout_s >= self.request_timeout_s, "rollout.job_timeout_s",
                 f"{self.job_timeout_s:g} s is shorter than one group's rollout.request_timeout_s "
                 f"({self.request_timeout_s:g} s); raise it, or lower rollout.request_timeout_s")
        _require(self.weight_sync in ("distributed", "tensor", "disk"), "rollout.weight_sync",
                 f"must be 'distributed', 'tensor' or 'disk', got {self.weight_sync!r}")
        _whole(self.weight_sync_bucket_mb, "rollout.weight_sync_bucket_mb", 1)
        if self.colocate:
            _require(self.engine == "sglang", "rollout.colocate",
                     "colocates SGLang servers with the trainer, but rollout.engine 'local' samples in the trainer "
                     "itself; set rollout.colocate to false, or rollout.engine to 'sglang'")
            _require(not (self.server_device == "cuda" and self.weight_sync == "distributed"), "rollout.weight_sync",
                     "'distributed' would put a server rank and a trainer rank of one NCCL group on the same GPU, "
                     "which NCCL refuses; colocated CUDA servers take 'tensor' (CUDA IPC) or 'disk'")
        _require(not self.server_nodes or self.colocate, "rollout.server_nodes",
                 "only colocated servers are matched to the trainer's nodes; set rollout.colocate to true or leave "
                 "rollout.server_nodes empty")
        _require(not self.server_nodes or len(self.server_nodes) == len(self.server_urls), "rollout.server_nodes",
                 f"names {len(self.server_nodes)} node(s) for {len(self.server_urls)} rollout.server_urls; give "
                 f"one node per URL, in the same order")
        for i, url in enumerate(self.server_urls):
            _check_server_url(url, f"rollout.server_urls[{i}]")


def _check_server_url(url: str, key: str) -> None:
    """A server's base URL as the servers are called: http(s)://HOST:PORT, nothing after it (the calls add their
    paths). Whether it answers is checked before the policy is built (rollout/server_check.py)."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as e:  # a port that is no number, or out of range
        raise ConfigError(f"{key}: {url!r} is not a URL ({e}); write it as http://HOST:PORT") from None
    _require(parts.scheme in ("http", "https") and bool(parts.hostname) and port is not None, key,
             f"{url!r} is not a server's URL; write it as http://HOST:PORT (a scheme, a host and a port)")
    _require(parts.path in ("", "/") and not parts.query and not parts.fragment, key,
             f"{url!r} has a path ({parts.path}{'?' + parts.query if parts.query else ''}); give the server's base "
             f"URL, http://{parts.netloc}")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100  # rollout steps the run trains for (a resumed run continues to this count)
    updates_per_step: int = 16  # optimizer steps per rollout step: the batch split into this many mini-batches
    output_dir: str = "runs/dapo"  # checkpoints, metrics.jsonl, train.log, tensorboard files
    checkpoint_every: int = 10  # 0: only at the end
    keep_last: int = 3  # complete checkpoints kept; older ones are removed once a newer one is complete
    resume: bool = True  # continue from the latest complete checkpoint in output_dir
    tensorboard: bool = True  # write the metrics as tensorboard events too, under output_dir/tensorboard
    max_bad_steps: int = 3  # rollout steps in a row with an update skipped for a non-finite loss or gradient
    # Seconds a rank may take to write its part of a checkpoint (a stalled filesystem): past it the run ends,
    # naming the rank and the folder; the previous complete checkpoint stays the latest.
    checkpoint_timeout_s: float = 1800.0

    def __post_init__(self):
        _whole(self.steps, "train.steps", 1)
        _whole(self.updates_per_step, "train.updates_per_step", 1)
        _require(bool(self.output_dir), "train.output_dir", "must name a folder for checkpoints and metrics")
        _whole(self.checkpoint_every, "train.checkpoint_every", 0)
        _whole(self.keep_last, "train.keep_last", 1)
        _whole(self.max_bad_steps, "train.max_bad_steps", 1)
        _positive(self.checkpoint_timeout_s, "train.checkpoint_timeout_s")


WANDB_MODES = ("online", "offline")


@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases, off unless `project` is set: rank 0 logs what tensorboard gets, and the run's config."""

    project: str | None = None  # the wandb project; null: wandb off
    entity: str | None = None  # the team or user; null: wandb's default for the logged-in user
    name: str | None = None  # the run's display name; null: the output folder's name
    mode: str = "online"  # "offline": files under OUT/wandb only, uploaded later with `wandb sync`

    def __post_init__(self):
        _require(self.mode in WANDB_MODES, "metrics.wandb.mode", f"must be one of {WANDB_MODES}, got {self.mode!r}")
        _require(self.project is None or bool(self.project), "metrics.wandb.project",
                 "must name a project, or be null to leave wandb off")
        # Refused here, not once the model is built: wandb is an optional extra.
        _require(self.project is None or importlib.util.find_spec("wandb") is not None, "metrics.wandb.project",
                 f"is {self.project!r}, but wandb is not installed: pip install 'megatron-dapo[wandb]', or set "
                 "metrics.wandb.project to null")


@dataclass(frozen=True)
class MetricsConfig:
    """Where the step metrics go besides output_dir/metrics.jsonl and tensorboard."""

    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation at its own sampling settings; the defaults are the paper's (avg@32 at temperature 1.0,
    top_p 0.7). Every evaluation draws with the same seed, so its curve follows the weights, not the draw."""

    every: int = 10  # rollout steps between evaluations; 0: none
    samples_per_prompt: int = 32  # k of avg@k and pass@k
    max_prompts: int = 256  # the first ones of data.eval_path
    temperature: float = 1.0  # sampling temperature of the evaluation
    top_p: float = 0.7  # nucleus sampling of the evaluation
    max_response_len: int | None = None  # tokens; null: algorithm.max_response_len
    seed: int = 0  # every evaluation samples with this seed

    def __post_init__(self):
        _whole(self.every, "eval.every", 0)
        _whole(self.samples_per_prompt, "eval.samples_per_prompt", 1)
        _whole(self.max_prompts, "eval.max_prompts", 1)
        _positive(self.temperature, "eval.temperature")
        _require(0 < self.top_p <= 1, "eval.top_p", f"must be in (0, 1], got {self.top_p}")
        if self.max_response_len is not None:
            _whole(self.max_response_len, "eval.max_response_len", 1)
        _whole(self.seed, "eval.seed", 0)
