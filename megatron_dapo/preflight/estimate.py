"""Worst-case estimates of a run from its config and its model's config.json (no weights, no GPU).

Worst case throughout: every response runs to algorithm.max_response_len, every prompt to
data.max_prompt_len, every micro-batch holds model.max_tokens_per_micro_batch tokens. GB = 10^9 bytes.

Trainer, per GPU (one tensor-parallel rank of one pipeline stage s):
  weights      the stage's parameters / TP (the vocabulary-parallel embedding on the first stage; the final
               norm and the output layer on the last; tied embeddings are one tensor at PP = 1 and a copy on
               the last stage otherwise), at model.dtype: 2 bytes each in bf16 (the default on GPUs), 4 in fp32;
               twice that with a KL term (loss.kl_coef > 0): the reference policy's stage sits beside it
  grads        4 bytes per parameter: our DDP reduces gradients in fp32 (grad_reduce_in_fp32)
  optimizer    Adam's m and v, plus an fp32 master copy of bf16 weights: 12 bytes per parameter (8 for fp32
               weights), divided by DP with optim.distributed_optimizer
  a mixture of experts: each rank holds E / EP experts of every MoE layer of its stage, whole (no expert TP), and
               their optimizer state is divided by the expert-data-parallel size, TP x DP / EP
  activations  ACT x max_tokens_per_micro_batch x the stage's layers x the micro-batches 1F1B keeps in flight
               on stage s: min(PP - s, micro-batches per DP rank per update).
               With model.activation_recompute "full" a layer keeps only its input, dtype bytes x h per token,
               and recomputes the rest in its backward, one layer at a time: dtype bytes x h instead of ACT,
               + ACT x max_tokens_per_micro_batch for the layer being recomputed
  logits       on the last stage: [max_tokens_per_micro_batch, padded vocab / TP] in the weights' dtype, and
               one fp32 chunk (at most 128 MiB) of the log-prob computation
ACT, bytes per token per layer, with h the hidden size, q = heads x head_dim, kv = KV heads x head_dim,
f the MLP width (SwiGLU, GQA, flash / SDPA attention, no sequence parallelism, what a layer keeps without
recomputation):
  dtype bytes x (4 h            the two RMSNorms' inputs and outputs, whole on every TP rank
                 + (q + 2 kv)/TP  Q, K, V after the rotary embedding, saved by the attention kernel
                 + q/TP           the attention output, linear_proj's input
                 + 4 f/TP)        SwiGLU: fc1's gate and up halves, silu(gate), and the product (fc2's input)
  + 4 bytes x heads/TP           the attention kernel's fp32 log-sum-exp
  On a layer with experts, 4 f/TP becomes k (3 h + 4 f_moe): each token's top k copies dispatched, received and
  combined, and SwiGLU in each of its k experts, with routing as balanced as it comes (a skewed router can put up
  to EP times that on one rank), + 8 bytes x E of fp32 router logits and probabilities. With sequence parallelism
  the norms' 4 h and the experts' term are split over TP too.
Context parallelism (CP): each rank holds 1/CP of every micro-batch's tokens, so the activations and logits count
max_tokens_per_micro_batch / CP tokens, and each layer also keeps the keys and values gathered from the other CP
ranks, dtype bytes x 2 kv/TP x (CP - 1)/CP per token of the micro-batch; the distributed optimizer divides the
state over DP x CP (an expert's over TP x CP x DP / EP).
Routing replay: the driver holds a batch's routes, every response of the groups drawn at the longest sequence x
MoE layers x top k ids of samples.route_dtype (uint8 up to 256 experts). Each trainer rank holds its share of the
trained batch's (batch_size x G / DP responses) on the host in that dtype, and on the GPU a micro-batch's as int64
ids (its tokens / TP with SP / CP x its stage's MoE layers x top k x 8 bytes), PP micro-batches' of them with
activation recompute (each queued until its backward recomputes the forward).

SGLang server, per GPU (TP = rollout.server_tensor_parallel):
  weights  all parameters x B / TP, B the bytes of model.dtype (2 in bf16, 4 in fp32): servers serve at it
  KV       per token: 2 (K, V) x layers x KV heads per GPU (KV heads / TP; at least 1, replicated when fewer
           than TP) x head_dim x B
  pool     GPU memory x the static memory fraction (SGLang's 0.88 unless rollout.server_extra_args sets
           --mem-fraction-static) - weights; a CPU server holds max_total_tokens tokens. SGLang reserves the
           static fraction when it starts, whatever the load.

Rollout time, on one server with its share of rollout.max_in_flight groups x G responses:
  concurrent  pool / KV bytes of one (max_prompt_len + max_response_len)-token sequence
  step        (weights + KV in use) / memory bandwidth + a fixed overhead: a decode step reads every weight
              and every cached token once
  total       ceil(sequences / concurrent) waves x max_response_len steps x step. A request can queue
              behind every group in flight, so rollout.request_timeout_s must cover the total.

Solo waits, how long trainer ranks sit inside one collective while others work, at DISK_BYTES_PER_S: a
checkpoint write (weights and optimizer state, split over the trainer nodes, each node writing its part) and,
with the disk weight sync, the servers loading its folder (the model's bytes) while global rank 0 waits on them.
Ranks waiting for a rollout are not counted: they wait outside collectives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from megatron_dapo.checkpoint.hf_mapping import (
    expected_hf_names,
    expert_of,
    hf_shape,
    layer_index,
    megatron_names,
    megatron_shape,
    tp_dim,
)
from megatron_dapo.config import ConfigError
from megatron_dapo.parallel.runtime import builds_for_gpu
from megatron_dapo.policy.hf_config import ModelSpec, model_spec_from_hf
from megatron_dapo.policy.logprobs import CHUNK_ELEMENTS
from megatron_dapo.policy.model import check_divisibility, padded_vocab_size
from megatron_dapo.rollout.from_config import check_served_as_trained, server_config
from megatron_dapo.run_config import DapoConfig
from megatron_dapo.samples import route_dtype

GB = 1e9
SHIPPED_MODELS = Path(__file__).resolve().parents[2] / "launch" / "models"

# The assumptions, in one place. Rough on purpose: they size timeouts and flag memory, they do not predict.
SGLANG_MEM_FRACTION_STATIC = 0.88  # SGLang's default share of a GPU for weights + KV cache
GPU_STEP_OVERHEAD_S = 0.01  # per decode step beyond memory traffic: scheduling, sampling, launches
CPU_SERVER_BYTES_PER_S = 20e9  # host memory bandwidth a CPU server's decode step streams at
CPU_STEP_OVERHEAD_S = 0.1  # per decode step on a CPU server: torch-native attention, Python
DISK_BYTES_PER_S = 1e9  # a node writing a checkpoint, or a server loading the weight-sync folder
GPUS_PER_NODE = 8  # trainer nodes = ceil(GPUs / this), for the per-node checkpoint write


@dataclass(frozen=True)
class Hardware:
    gpu_memory_gb: float = 80.0
    gpu_bandwidth_tbs: float = 3.35  # H100 SXM's HBM3
    gpus: int | None = None  # trainer processes (the world size); None: inferred from the config

    def __post_init__(self):
        for flag, value in (("--gpu-memory-gb", self.gpu_memory_gb), ("--gpu-bandwidth-tbs", self.gpu_bandwidth_tbs)):
            if not value > 0:
                raise ConfigError(f"{flag}: must be > 0, got {value}")
        if self.gpus is not None and self.gpus < 1:
            raise ConfigError(f"--gpus: must be >= 1, got {self.gpus}")


def model_architecture(model_path: str) -> tuple[ModelSpec, Path]:
    """The model's shape from model.path/config.json, else from the copy shipped in launch/models/<name>/."""
    own = Path(model_path) / "config.json"
    shipped = SHIPPED_MODELS / Path(model_path).name / "config.json"
    for path in (own, shipped):
        if path.is_file():
            return model_spec_from_hf(path), path
    demo = Path(model_path).name == "warm"  # `megatron-dapo demo --output DIR` makes DIR/warm
    hint = (f"run `megatron-dapo demo --output {Path(model_path).parent}` first, which makes it, or point model.path "
            "at a model folder") if demo else (f"point model.path at a Hugging Face model folder, or put the model's "
                                               f"config.json in {SHIPPED_MODELS / Path(model_path).name}/")
    raise ConfigError(f"model.path: no config.json in {model_path} and no architecture shipped for "
                      f"{Path(model_path).name!r} in launch/models/; {hint}")


def model_parameters(spec: ModelSpec) -> int:
    """All parameters, as the Hugging Face checkpoint (and an SGLang server) holds them."""
    return sum(math.prod(hf_shape(name, spec)) for name in expected_hf_names(spec))


def trainer_bytes_per_parameter(cfg: DapoConfig) -> tuple[int, int]:
    """(weights, optimizer state) at the dtype the run trains in (model.dtype): bf16 weights with an fp32 master
    copy and Adam's m and v, or fp32 weights with m and v."""
    bf16 = cfg.model.training_dtype(builds_for_gpu(cfg.parallel)) == "bfloat16"
    return (2, 12) if bf16 else (4, 8)


@dataclass(frozen=True)
class Layout:
    gpus: int  # trainer processes
    data_parallel: int
    nodes: int  # trainer nodes
    servers: int  # SGLang servers
    assumption: str  # where `gpus` came from


def trainer_layout(cfg: DapoConfig, spec: ModelSpec, gpus: int | None) -> Layout:
    """The trainer's GPUs (`gpus`, else assumed) and the SGLang servers: one per URL given; colocated on GPUs, one
    per server TP of the trainer's GPUs (as the SLURM launcher starts them); else rollout.num_servers."""
    p, r = cfg.parallel, cfg.rollout
    check_divisibility(spec, p)
    per_trainer_gpu = r.colocate and r.server_device == "cuda" and not r.server_urls
    gpus, assumption = (gpus, "given") if gpus is not None else _assumed_gpus(cfg, per_trainer_gpu)
    servers = len(r.server_urls) or (gpus // r.server_tensor_parallel if per_trainer_gpu else r.num_servers)
    dp = p.data_parallel(gpus)
    cfg.algorithm.check_data_parallel(dp)
    nodes = math.ceil(gpus / GPUS_PER_NODE) if p.device == "cuda" else 1
    return Layout(gpus, dp, nodes, max(servers, 1), assumption)


def _assumed_gpus(cfg: DapoConfig, per_trainer_gpu: bool) -> tuple[int, str]:
    """Colocated: one node. GPU trainer beside GPU servers: as many GPUs as the servers (the shipped layouts split
    the nodes evenly). Else: data parallel 1."""
    p, r = cfg.parallel, cfg.rollout
    change = "--gpus N to change"
    if per_trainer_gpu:
        return GPUS_PER_NODE, f"assumed: one {GPUS_PER_NODE}-GPU node; {change}"
    serving = (len(r.server_urls) or r.num_servers) * r.server_tensor_parallel
    if r.engine == "sglang" and p.device == r.server_device == "cuda" and serving % p.model_parallel == 0:
        return serving, f"assumed: as many as the SGLang servers use; {change}"
    return p.model_parallel, f"assumed: data parallel 1; {change}"


def longest_sequence(cfg: DapoConfig) -> int:
    return cfg.data.max_prompt_len + cfg.algorithm.max_response_len


@dataclass(frozen=True)
class TrainerMemory:
    """Bytes on one GPU of pipeline stage `stage`."""

    stage: int
    layers: int
    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    recompute: bool = False  # model.activation_recompute "full": `activations` are the layers' inputs + one layer

    @property
    def state(self) -> float:
        """What stays allocated between steps (all a colocated server shares its GPU with)."""
        return self.weights + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.state + self.activations + self.logits


def stage_parameters(spec: ModelSpec, tp: int, pp: int, ep: int = 1, experts: bool = False) -> list[int]:
    """Parameters on one rank of each pipeline stage: without `experts`, all but a mixture of experts' experts (split
    over TP where megatron-core splits them); with it, the experts alone (E / EP of them on each rank, whole)."""
    vocab = padded_vocab_size(spec.vocab_size, tp)

    def shard(name: str) -> int:
        if (expert_of(name) is not None) != experts:
            return 0
        n = math.prod(megatron_shape(name, spec, vocab))
        return n // ep if experts else n // tp if tp_dim(name) is not None else n

    per_layer = [0] * spec.num_layers
    for name in megatron_names(spec):
        layer = layer_index(name)
        if layer is not None:
            per_layer[layer] += shard(name)
    per_stage = spec.num_layers // pp
    stages = [sum(per_layer[i * per_stage:(i + 1) * per_stage]) for i in range(pp)]
    embedding = shard("embedding.word_embeddings.weight")
    stages[0] += embedding
    output = 0 if spec.tie_word_embeddings and pp == 1 else embedding
    stages[-1] += shard("decoder.final_layernorm.weight") + output
    return stages


def activation_bytes(spec: ModelSpec, tp: int, dtype_bytes: int, sparse: bool = False,
                     sequence_parallel: bool = False) -> float:
    """ACT of the module docstring: bytes saved for the backward per token per layer, without recomputation; of a
    layer with experts (`sparse`) or a dense one."""
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_attention_heads * d, spec.num_query_groups * d
    mlp = 4 * spec.ffn_hidden_size / tp
    if sparse:  # each token's top k copies, dispatched and combined, through SwiGLU experts of moe_ffn_hidden_size
        k = spec.moe_topk
        mlp = (k * (3 * h + 4 * spec.moe_ffn_hidden_size)) / (tp if sequence_parallel else 1)
        mlp += 4 * spec.shared_expert_ffn_hidden_size / tp  # a shared expert: every token, split over TP
    elements = 4 * h / (tp if sequence_parallel else 1) + (q + 2 * kv) / tp + q / tp + mlp
    router = 4 * spec.num_experts * 2 if sparse else 0  # fp32 logits and probabilities over the experts
    return dtype_bytes * elements + 4 * spec.num_attention_heads / tp + router


def trainer_memory(cfg: DapoConfig, spec: ModelSpec, layout: Layout) -> list[TrainerMemory]:
    p = cfg.parallel
    tp, pp, ep, cp = p.tensor_parallel, p.pipeline_parallel, p.expert_parallel, p.context_parallel
    dtype_bytes, optimizer_bytes = trainer_bytes_per_parameter(cfg)
    # the distributed optimizer splits a parameter's state over the ranks that hold it: the data- and
    # context-parallel ones, and for an expert the expert-data-parallel ones (a stage's TP x CP x DP ranks over EP)
    dense_share = layout.data_parallel * cp if cfg.optim.distributed_optimizer else 1
    expert_share = tp * cp * layout.data_parallel // ep if cfg.optim.distributed_optimizer else 1
    micro_batch_tokens = cfg.model.max_tokens_per_micro_batch
    tokens = micro_batch_tokens / cp  # this rank's share of a micro-batch
    # the keys and values each layer gathers from the other CP ranks, per token of the micro-batch
    gathered_kv = dtype_bytes * 2 * spec.num_query_groups * spec.head_dim / tp * (cp - 1) / cp
    g = cfg.algorithm
    responses = math.ceil(g.batch_size * g.group_size / cfg.train.updates_per_step / layout.data_parallel)
    micro_batches = math.ceil(responses / max(1, micro_batch_tokens // longest_sequence(cfg)))
    recompute = cfg.model.activation_recompute == "full"
    per_stage = spec.num_layers // pp
    sparse = spec.moe_layers or (False,) * spec.num_layers
    columns = padded_vocab_size(spec.vocab_size, tp) // tp
    logits = tokens * columns * dtype_bytes + min(CHUNK_ELEMENTS, tokens * columns) * 4
    copies = 2 if cfg.loss.kl_coef > 0 else 1  # the policy, and the KL term's reference
    out = []
    for s, (dense, experts) in enumerate(zip(stage_parameters(spec, tp, pp), stage_parameters(spec, tp, pp, ep, True))):
        full = [activation_bytes(spec, tp, dtype_bytes, sparse[i], p.sequence_parallel)
                for i in range(s * per_stage, (s + 1) * per_stage)]  # per token, each layer of the stage
        kept = dtype_bytes * spec.hidden_size * per_stage if recompute else sum(full)  # per token
        kept += 0.0 if recompute else gathered_kv * cp * per_stage
        recomputing = (max(full) + gathered_kv * cp) * tokens if recompute else 0.0  # the layer whose backward runs
        n = dense + experts
        out.append(TrainerMemory(stage=s, layers=per_stage, weights=copies * n * dtype_bytes, grads=n * 4,
                                 optimizer=optimizer_bytes * (dense / dense_share + experts / expert_share),
                                 activations=kept * tokens * min(pp - s, micro_batches) + recomputing,
                                 logits=logits if s == pp - 1 else 0.0, recompute=recompute))
    return out


def route_bytes(cfg: DapoConfig, spec: ModelSpec) -> float:
    """Host memory of a batch's routes on the driver (rollout.routing_replay), worst case: every response of every
    group drawn for the batch (algorithm.oversample_factor over batch_size) at the longest sequence, each position
    its MoE layers' top-k ids in samples.route_dtype."""
    if not (spec.is_moe and cfg.rollout.routing_replay):
        return 0.0
    g = cfg.algorithm
    responses = math.ceil(g.batch_size * g.oversample_factor) * g.group_size
    return responses * longest_sequence(cfg) * sum(spec.moe_layers) * spec.moe_topk * \
        route_dtype(spec.num_experts).itemsize


def rank_route_bytes(cfg: DapoConfig, spec: ModelSpec, layout: Layout) -> tuple[float, float]:
    """(host, GPU) bytes of routes on one trainer rank (rollout.routing_replay; see the module's note), worst case:
    every sequence at the longest, the stage with the most MoE layers."""
    if not (spec.is_moe and cfg.rollout.routing_replay):
        return 0.0, 0.0
    p, g = cfg.parallel, cfg.algorithm
    k = spec.moe_topk
    responses = math.ceil(g.batch_size * g.group_size / layout.data_parallel)
    host = responses * longest_sequence(cfg) * sum(spec.moe_layers) * k * route_dtype(spec.num_experts).itemsize
    per_stage = spec.num_layers // p.pipeline_parallel
    stage_moe = max(sum(spec.moe_layers[s * per_stage:(s + 1) * per_stage]) for s in range(p.pipeline_parallel))
    tokens = cfg.model.max_tokens_per_micro_batch / (p.tensor_parallel if p.sequence_parallel else 1) / \
        p.context_parallel
    queued = p.pipeline_parallel if cfg.model.activation_recompute == "full" else 1
    return host, tokens * stage_moe * k * 8 * queued


@dataclass(frozen=True)
class ServerEstimate:
    """One SGLang server GPU, and the server's worst-case time for its share of the groups in flight."""

    servers: int
    tensor_parallel: int
    on_cpu: bool
    mem_fraction: float  # of GPU memory reserved at start (GPU servers)
    weights: float  # bytes per GPU
    kv_per_token: float  # bytes per GPU
    pool: float  # KV cache bytes per GPU
    reserved: float  # bytes the server holds on its GPU from the start
    seq_len: int  # prompt + response, worst case
    response_len: int
    sequences: int  # its share of max_in_flight groups x G
    concurrent: int  # full-length sequences its pool holds at once
    step_s: float  # one decode step with `min(sequences, concurrent)` of them running

    @property
    def kv_needed(self) -> float:
        return self.sequences * self.seq_len * self.kv_per_token

    @property
    def waves(self) -> int:
        return math.ceil(self.sequences / self.concurrent)

    @property
    def rollout_s(self) -> float:
        """Worst case for all of its sequences: what the last request in its queue waits."""
        return self.waves * self.response_len * self.step_s


def mem_fraction_static(extra_args: list[str]) -> float:
    """`--mem-fraction-static F` (or `=F`) from the server's extra arguments, else SGLang's default."""
    flag = "--mem-fraction-static"
    for i, arg in enumerate(extra_args):
        if arg == flag and i + 1 < len(extra_args):
            value = extra_args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
        else:
            continue
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"rollout.server_extra_args: {flag} needs a number, got {value!r}") from None
    return SGLANG_MEM_FRACTION_STATIC


def server_estimate(cfg: DapoConfig, spec: ModelSpec, layout: Layout, hw: Hardware) -> ServerEstimate:
    """Raises ConfigError when the server cannot run one full-length sequence."""
    r = cfg.rollout
    check_served_as_trained(spec)
    server = server_config(cfg)  # what the run starts: dtype, CPU token budget, extra args
    tp, on_cpu = server.tensor_parallel, server.device == "cpu"
    if spec.num_attention_heads % tp:
        raise ConfigError(f"rollout.server_tensor_parallel: the model's {spec.num_attention_heads} attention heads do "
                          f"not divide over {tp} GPUs; choose a TP that divides them")
    dtype_bytes = 4 if server.dtype == "float32" else 2
    weights = model_parameters(spec) * dtype_bytes / tp
    kv_per_token = 2 * spec.num_layers * math.ceil(spec.num_query_groups / tp) * spec.head_dim * dtype_bytes
    seq_len = longest_sequence(cfg)
    if on_cpu:
        fraction, pool = 0.0, server.max_total_tokens * kv_per_token
        reserved, bandwidth, overhead = weights + pool, CPU_SERVER_BYTES_PER_S, CPU_STEP_OVERHEAD_S
        if seq_len > server.max_total_tokens:
            raise ConfigError(f"data.max_prompt_len + algorithm.max_response_len: {seq_len} tokens exceed a CPU "
                              f"server's KV cache of {server.max_total_tokens} tokens; shorten them")
    else:
        fraction = mem_fraction_static(server.extra_args)
        reserved = fraction * hw.gpu_memory_gb * GB
        pool, bandwidth, overhead = reserved - weights, hw.gpu_bandwidth_tbs * 1e12, GPU_STEP_OVERHEAD_S
        if pool < seq_len * kv_per_token:
            raise ConfigError(
                f"rollout.server_tensor_parallel: at TP{tp} a server GPU holds {weights / GB:.1f} GB of weights and "
                f"{max(pool, 0) / GB:.1f} GB of KV cache ({fraction:g} x {hw.gpu_memory_gb:g} GB), less than one "
                f"{seq_len}-token sequence needs ({seq_len * kv_per_token / GB:.1f} GB); raise "
                f"rollout.server_tensor_parallel or --mem-fraction-static in rollout.server_extra_args")
    g = cfg.algorithm
    sequences = math.ceil(r.max_in_flight / layout.servers) * g.group_size
    concurrent = int(pool // (seq_len * kv_per_token))
    running = min(sequences, concurrent)
    step_s = (weights + running * seq_len * kv_per_token) / bandwidth + overhead
    return ServerEstimate(servers=layout.servers, tensor_parallel=tp, on_cpu=on_cpu, mem_fraction=fraction,
                          weights=weights, kv_per_token=kv_per_token, pool=pool, reserved=reserved, seq_len=seq_len,
                          response_len=g.max_response_len, sequences=sequences, concurrent=concurrent, step_s=step_s)


def weight_folder_bytes(cfg: DapoConfig, spec: ModelSpec) -> float:
    """What the disk weight sync writes and every server loads: the trainer's weights in their dtype."""
    return model_parameters(spec) * trainer_bytes_per_parameter(cfg)[0]


@dataclass(frozen=True)
class SoloWait:
    """Trainer ranks waiting inside one collective while others move `nbytes` to or from disk."""

    cause: str
    nbytes: float

    @property
    def seconds(self) -> float:
        return self.nbytes / DISK_BYTES_PER_S


def solo_waits(cfg: DapoConfig, spec: ModelSpec, layout: Layout) -> list[SoloWait]:
    # The optimizer's shards add up to the whole model's state, written once.
    checkpoint = model_parameters(spec) * sum(trainer_bytes_per_parameter(cfg))
    waits = [SoloWait("a checkpoint write, per node", checkpoint / layout.nodes)]
    if cfg.rollout.engine == "sglang" and cfg.rollout.weight_sync == "disk":
        waits.append(SoloWait("the servers loading the disk weight sync's folder", weight_folder_bytes(cfg, spec)))
    return waits
