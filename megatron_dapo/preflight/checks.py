"""The checks a run's config must pass before any GPU hour is spent, and the table of estimates they rest on.

A check that fails is a ConfigError naming the config key and the fix. Memory over the GPU's size is a
warning only: the estimates are worst cases (see megatron_dapo.preflight.estimate).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

from megatron_dapo.config import ConfigError
from megatron_dapo.policy.hf_config import ModelSpec
from megatron_dapo.preflight.estimate import (
    DISK_BYTES_PER_S,
    GB,
    Hardware,
    Layout,
    ServerEstimate,
    SoloWait,
    TrainerMemory,
    longest_sequence,
    model_architecture,
    model_parameters,
    rank_route_bytes,
    server_estimate,
    solo_waits,
    trainer_layout,
    route_bytes,
    trainer_memory,
    weight_folder_bytes,
)
from megatron_dapo.run_config import DapoConfig

HEADROOM = 1.5  # suggested timeouts: the estimate times this


@dataclass(frozen=True)
class Check:
    key: str
    ok: bool
    message: str  # what was compared; on failure also the fix


@dataclass(frozen=True)
class Report:
    text: str  # the estimates: model, layout, memory table, rollout time, waits, warnings
    checks: list[Check]

    def render(self) -> str:
        lines = [f"  {'ok' if c.ok else 'FAIL':<6}{c.key}: {c.message}" for c in self.checks]
        return "\n".join([self.text, "checks", *lines])

    def raise_first_failure(self) -> None:
        for c in self.checks:
            if not c.ok:
                raise ConfigError(f"{c.key}: {c.message}")


def preflight(cfg: DapoConfig, hardware: Hardware = Hardware(), files: bool = False) -> Report:
    """Estimates and checks for `cfg`; raises ConfigError at once when an estimate cannot even be made. `files`:
    also check the files the run reads (`megatron-dapo train` does, where it runs; `megatron-dapo preflight` may run
    where they are not)."""
    spec, source = model_architecture(cfg.model.path)
    layout = trainer_layout(cfg, spec, hardware.gpus)
    stages = trainer_memory(cfg, spec, layout)
    # What model.activation_recompute "full" would leave, for the warnings when it is off.
    recomputed = (trainer_memory(replace(cfg, model=replace(cfg.model, activation_recompute="full")), spec, layout)
                  if cfg.model.activation_recompute == "none" else None)
    server = server_estimate(cfg, spec, layout, hardware) if cfg.rollout.engine == "sglang" else None
    waits = solo_waits(cfg, spec, layout)
    params = model_parameters(spec)
    p = cfg.parallel
    processes = ("GPU", "GPUs") if p.device == "cuda" else ("process", "processes")
    text = "\n".join([
        f"model     {spec.architecture}, {params / 1e9:.2f} B parameters" if params >= 1e8 else
        f"model     {spec.architecture}, {params / 1e6:.2f} M parameters",
        f"          {spec.num_layers} layers, {spec.max_position_embeddings} positions ({os.path.relpath(source)})",
        f"trainer   {layout.gpus} {processes[layout.gpus > 1]} = TP{p.tensor_parallel} x PP{p.pipeline_parallel} "
        + (f"x CP{p.context_parallel} " if p.context_parallel > 1 else "")
        + f"x DP{layout.data_parallel}" + (f", experts over EP{p.expert_parallel}" if spec.is_moe else "")
        + f" ({layout.assumption})",
        *([f"experts   {spec.num_experts} per MoE layer ({sum(spec.moe_layers)} of {spec.num_layers}), top "
           f"{spec.moe_topk}: {spec.num_experts // p.expert_parallel} per rank"] if spec.is_moe else []),
        f"hardware  {hardware.gpu_memory_gb:g} GB and {hardware.gpu_bandwidth_tbs:g} TB/s per GPU "
        "(--gpu-memory-gb, --gpu-bandwidth-tbs)",
        "",
        *_memory_table(cfg, stages, server, hardware, recomputed),
        "",
        *_rollout_lines(cfg, server),
        *_route_lines(cfg, spec, layout),
        "solo wait " + "; ".join(f"{w.cause}: {_size(w.nbytes)} at {DISK_BYTES_PER_S / GB:g} GB/s = {w.seconds:.0f} s"
                                 for w in waits),
    ])
    checks = [*_sequence_checks(cfg, spec), *_timeout_checks(cfg, spec, server, waits),
              *(_file_checks(cfg) if files else [])]
    return Report(text, checks)


def _route_lines(cfg: DapoConfig, spec: ModelSpec, layout: Layout) -> list[str]:
    """Routing replay's memory: the driver's batch, and each trainer rank's share (rank_route_bytes)."""
    if not route_bytes(cfg, spec):
        return []
    host, gpu = rank_route_bytes(cfg, spec, layout)
    where = "GPU" if cfg.parallel.device == "cuda" else "device"
    return [f"routes    a batch's routes on the driver (rollout.routing_replay): {_size(route_bytes(cfg, spec))} of "
            "host memory, worst case",
            f"          per trainer rank: {_size(host)} on the host (its share of the batch), {_size(gpu)} on the "
            f"{where} (a micro-batch's int64 ids for its stage's MoE layers"
            + (f", x PP{cfg.parallel.pipeline_parallel} queued for recomputes)" if
               cfg.model.activation_recompute == "full" and cfg.parallel.pipeline_parallel > 1 else ")")]


def _size(nbytes: float) -> str:
    return f"{nbytes / GB:.1f} GB" if nbytes >= 0.1 * GB else f"{nbytes / 1e6:.1f} MB"


def _memory_table(cfg: DapoConfig, stages: list[TrainerMemory], server: ServerEstimate | None,
                  hw: Hardware, recomputed: list[TrainerMemory] | None = None) -> list[str]:
    """Rows of (name, weights, grads, optimizer, activations, logits, KV cache, total), and a warning for each
    total that must fit in one GPU and does not; a trainer stage's warning says what `recomputed` (the stages
    with activation recompute, when it is off) would need."""
    on_gpu = cfg.parallel.device == "cuda"
    rows = [(f"trainer stage {m.stage} ({m.layers} layers)", m.weights, m.grads, m.optimizer, m.activations,
             m.logits, 0, m.total) for m in stages]
    on_one_gpu = list(rows) if on_gpu else []
    if server is not None:
        where = "CPU" if server.on_cpu else f"TP{server.tensor_parallel}"
        rows.append((f"SGLang server ({where})", server.weights, 0, 0, 0, 0, server.pool, server.reserved))
        on_one_gpu += [] if server.on_cpu else rows[-1:]
        if cfg.rollout.colocate and on_gpu and not server.on_cpu:
            # Weights, gradients and optimizer state stay while the server runs; the server has released its
            # memory while the trainer's activations exist.
            shared = max(max(m.total for m in stages), max(m.state for m in stages) + server.reserved)
            rows.append(("colocated: trainer + server", 0, 0, 0, 0, 0, 0, shared))
            on_one_gpu = rows[-1:]
    unit, scale = ("GB", GB) if max(r[-1] for r in rows) >= GB else ("MB", 1e6)
    head = f"per {'GPU' if on_gpu else 'process'}, {unit}"
    width = max(len(head), *(len(r[0]) for r in rows)) + 2
    columns = ("weights", "grads", "optimizer", "activations", "logits", "KV cache", "total")
    lines = [f"{head:<{width}}" + "".join(f"{c:>12}" for c in columns)]
    lines += [f"{name:<{width}}" + "".join(f"{v / scale:>12.1f}" if v else f"{'-':>12}" for v in values)
              for name, *values in rows]
    if server is not None and not server.on_cpu:
        lines.append(f"(SGLang reserves --mem-fraction-static {server.mem_fraction:g} of each GPU when it starts)")
    if any(m.recompute for m in stages):
        lines.append("(model.activation_recompute: full: activations are each layer's input, plus one layer's "
                     "while it is recomputed)")
    if not on_gpu:
        lines.append("(parallel.device: cpu: no GPU memory check applies to the trainer)")
    hints = {rows[i][0]: f"; with model.activation_recompute: full about {m.total / GB:.1f} GB"
             for i, m in enumerate(recomputed or [])}
    lines += [f"warning: {name} needs about {total / GB:.1f} GB per GPU, more than --gpu-memory-gb "
              f"{hw.gpu_memory_gb:g}{hints.get(name, '')}"
              for name, *_, total in on_one_gpu if total > hw.gpu_memory_gb * GB]
    return lines


def _rollout_lines(cfg: DapoConfig, server: ServerEstimate | None) -> list[str]:
    if server is None:
        return ["rollout   in the trainer (rollout.engine: local): no server, no request timeout"]
    g = cfg.algorithm
    return [f"rollout   worst case per server (of {server.servers}): {server.sequences // g.group_size} of "
            f"rollout.max_in_flight {cfg.rollout.max_in_flight} groups x {g.group_size} = {server.sequences} sequences "
            f"of {server.seq_len} tokens",
            f"          KV cache {_size(server.kv_needed)}, {server.concurrent} sequences fit at once: "
            f"{server.waves} wave(s) x {server.response_len} decode steps x {1e3 * server.step_s:.1f} ms "
            f"= {server.rollout_s:.0f} s"]


# Any one of them makes a tokenizer transformers can load (fast, sentencepiece or BPE files).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def _file_checks(cfg: DapoConfig) -> list[Check]:
    """The prompt files and the model's tokenizer are there: a typo costs seconds here, not a setup of every rank."""
    checks = []
    for key in ("data.train_path", "data.eval_path"):
        path = getattr(cfg.data, key.split(".")[1])
        if path:
            there = Path(path).is_file()
            checks.append(Check(key, there, f"{path} is a file" if there else
                                f"{path} is not a file{_near(Path(path))}; fix the path"))
    model = Path(cfg.model.path)
    found = [name for name in TOKENIZER_FILES if (model / name).is_file()]
    checks.append(Check("model.path", bool(found), f"{model} has a tokenizer ({found[0]})" if found else
                        f"{model} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}, with "
                        "tokenizer_config.json); copy them from the model's Hugging Face folder"))
    return checks


def _near(path: Path) -> str:
    """What the folder that should hold `path` holds, for a typo to be seen."""
    if not path.parent.is_dir():
        return f" (no folder {path.parent})"
    names = sorted(p.name for p in path.parent.iterdir() if p.suffix in (".jsonl", ".parquet"))
    return f" ({path.parent} holds {', '.join(names[:8])})" if names else f" ({path.parent} holds no prompt file)"


def _sequence_checks(cfg: DapoConfig, spec: ModelSpec) -> list[Check]:
    longest = longest_sequence(cfg)
    sums = f"data.max_prompt_len + algorithm.max_response_len = {cfg.data.max_prompt_len} + " \
           f"{cfg.algorithm.max_response_len} = {longest}"
    budget = cfg.model.max_tokens_per_micro_batch
    positions = spec.max_position_embeddings
    return [
        Check("model.max_tokens_per_micro_batch", budget >= longest,
              f"{budget} >= the longest sequence, {sums}" if budget >= longest else
              f"{budget} tokens cannot hold the longest sequence, {sums}; raise it to at least {longest}"),
        Check("data.max_prompt_len + algorithm.max_response_len", longest <= positions,
              f"{longest} <= the model's max_position_embeddings {positions}" if longest <= positions else
              f"{longest} tokens exceed the model's max_position_embeddings {positions}; lower them to a sum "
              f"<= {positions}"),
    ]


def _timeout_checks(cfg: DapoConfig, spec: ModelSpec, server: ServerEstimate | None,
                    waits: list[SoloWait]) -> list[Check]:
    r = cfg.rollout
    checks = []
    if server is not None:
        checks.append(_timeout("rollout.request_timeout_s", r.request_timeout_s, server.rollout_s,
                               f"the worst-case time of the {r.max_in_flight} groups in flight (a request can queue "
                               "behind all of them)", also=" or lower rollout.max_in_flight"))
        if r.weight_sync == "disk":
            checks.append(_timeout("rollout.weight_sync_timeout_s", r.weight_sync_timeout_s,
                                   weight_folder_bytes(cfg, spec) / DISK_BYTES_PER_S,
                                   "a server loading the disk weight sync's folder"))
    longest = max(waits, key=lambda w: w.seconds)
    checks.append(_timeout("parallel.distributed_timeout_minutes", 60 * cfg.parallel.distributed_timeout_minutes,
                           longest.seconds, f"the longest wait inside one collective ({longest.cause})", minutes=True))
    return checks


def _timeout(key: str, have_s: float, need_s: float, what: str, also: str = "", minutes: bool = False) -> Check:
    def show(seconds: float) -> str:
        return f"{seconds / 60:.1f} min" if minutes else f"{seconds:.0f} s"

    if have_s >= need_s:
        return Check(key, True, f"{show(have_s)} >= {show(need_s)}, {what}")
    suggested = 60 * math.ceil(HEADROOM * need_s / 60)  # whole minutes
    return Check(key, False, f"{show(have_s)} is shorter than {what}: {show(need_s)}; set it to "
                             f"{suggested // 60 if minutes else suggested}{also}")
