"""One training step of the policy on one GPU against the machine's limits: tokens/s, model TFLOP/s, MFU, where the
time goes, and the peak memory beside preflight's estimate of it.

The policy is Qwen2.5-1.5B-shaped (launch/models/Qwen2.5-1.5B/config.json; random weights, nothing downloaded),
built as a run builds it: megatron-core's GPTModel at model.dtype "auto" (bf16 on GPUs, with the fp32 master copy),
the local layer spec with SDPA attention, PolicyTrainer's step (DDP, megatron-core's Adam, gradient clipping), the
fused loss on vocabulary-parallel log-probs. The batch has DAPO-like lengths (prompts of 64-512 tokens, responses
log-normal around 1.5k tokens, cut at the micro-batch), packed into micro-batches of --micro-batch-tokens, about
--tokens per step.

FLOPs, per step: 6 x (the matmul parameters: attention and MLP projections, and the output layer) x tokens, plus
causal attention at half the square: 6 x layers x s^2 x (heads x head_dim) per sequence of s tokens (QK^T and AV,
forward and twice in backward). MFU is model FLOP/s over the GPU's dense bf16 peak (--peak-tflops, else the
datasheet's for H100 / H200 / A100), and over a bf16 GEMM measured in the same run (n x n x n, n = --gemm-n). The
time split syncs the device at each boundary: forward (the model up to the logits), log-probs + loss, optimizer
step, and backward (the rest of the step: the backward pass and the gradient reduction).

Peak memory is torch.cuda.max_memory_allocated over the measured steps, beside preflight's estimate for the same
model and micro-batch (preflight/estimate.py's trainer_memory); what stays allocated between steps
(torch.cuda.memory_allocated after the warm-up step) beside preflight's weights + grads + optimizer state, so that
an estimate that is off says whether the state or the activations are; and preflight's parts. On the CPU there
is no allocator to ask, and the rows say so. On the CPU with MEGATRON_DAPO_DEVICE_FAITHFUL=1 (the suite, --tiny)
the step follows the GPU's placement and precision.

--fusions measures, side by side in one run, the step as shipped and the step with each of megatron-core's fusions
that apply to the local layer spec turned on alone (TransformerConfig's flags; a fresh model each): the SwiGLU and
the residual add through its jit fuser (torch.compile), RoPE and the weight-gradient accumulation, which need
Transformer Engine or apex kernels (where those are missing the row says why). Each row's step time is given as a
ratio to a shipped step measured right after it, so the machine's drift stays out of the ratio.

    python bench/bench_train_step.py [--device cuda] [--tokens 32768] [--micro-batch-tokens 8192] [--steps 3]
    python bench/bench_train_step.py --device cuda --fusions --tokens 16384 --steps 2
    python bench/bench_train_step.py --device cpu --tiny       # the suite's size
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from model_shapes import one_rank

# Dense bf16 peaks from the datasheets (SXM parts), TFLOP/s.
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0}
# megatron-core's fusions that the local layer spec reaches (masked_softmax_fusion and persist_layer_norm belong to
# layers it does not use: SDPA attention, torch's RMSNorm).
FUSIONS = ("bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion", "gradient_accumulation_fusion")


def lengths(total: int, mb_tokens: int, seed: int) -> list[tuple[int, int]]:
    """(prompt, response) lengths, DAPO-like, until `total` tokens; each sequence fits one micro-batch."""
    g = torch.Generator().manual_seed(seed)
    out, tokens = [], 0
    while tokens < total:
        prompt = int(torch.randint(64, 513, (1,), generator=g))
        response = int(torch.empty(1).log_normal_(math.log(1500), 0.7, generator=g).clamp(16, mb_tokens - prompt))
        prompt, response = min(prompt, mb_tokens // 4), min(response, mb_tokens - min(prompt, mb_tokens // 4))
        out.append((prompt, response))
        tokens += prompt + response
    return out


def batch(spec, shape: list[tuple[int, int]], seed: int):
    from megatron_dapo.policy.batch import Sequence
    from megatron_dapo.policy.train_step import RolloutSample

    g = torch.Generator().manual_seed(seed)
    samples = []
    for prompt, response in shape:
        ids = torch.randint(0, spec.vocab_size, (prompt + response,), generator=g)
        old = -torch.rand(response, generator=g) * 3
        adv = torch.full((response,), float(torch.randn(1, generator=g)))
        samples.append(RolloutSample(Sequence(ids, prompt), old, adv, torch.ones(response, dtype=torch.bool)))
    return samples


def step_flops(spec, shape: list[tuple[int, int]]) -> float:
    h, d, f = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size
    q, kv = spec.num_attention_heads * d, spec.num_query_groups * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * f
    matmul = spec.num_layers * per_layer + h * spec.vocab_size
    tokens = sum(p + r for p, r in shape)
    attention = sum(6 * spec.num_layers * (p + r) ** 2 * q for p, r in shape)
    return 6 * matmul * tokens + attention


class Split:
    """Seconds per part of the step, the device synced at each boundary."""

    def __init__(self, device: torch.device):
        self.device, self.seconds = device, {}

    def sync(self):
        if self.device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize(self.device)

    @contextmanager
    def part(self, name: str):
        self.sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    @contextmanager
    def timing(self, owner, attr: str, name: str):
        """`owner.attr` timed as part `name` while inside."""
        original = getattr(owner, attr)

        def timed(*args, **kwargs):
            with self.part(name):
                return original(*args, **kwargs)

        setattr(owner, attr, timed)
        try:
            yield
        finally:
            setattr(owner, attr, original)


def gemm_tflops(n: int, device: torch.device, dtype: torch.dtype) -> float:
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    split = Split(device)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(5):
        with split.part("gemm"):
            a @ b
        times.append(split.seconds.pop("gemm"))
    return 2 * n**3 / statistics.median(times) / 1e12


def preflight_memory(model_dir: Path, device: str, args):
    """preflight's trainer memory (TrainerMemory) for this model, layout and micro-batch (one GPU, PP = 1)."""
    from megatron_dapo.preflight.estimate import model_architecture, trainer_layout, trainer_memory
    from megatron_dapo.run_config import config_from_dict

    cfg = config_from_dict({
        "model": {"path": str(model_dir), "max_tokens_per_micro_batch": args.micro_batch_tokens},
        "data": {"train_path": "unused.jsonl", "max_prompt_len": args.micro_batch_tokens // 4},
        "parallel": {"device": device},
        "algorithm": {"batch_size": 1, "group_size": 2, "max_response_len": args.micro_batch_tokens * 3 // 4,
                      "overlong_cache_len": 0},
        "optim": {"distributed_optimizer": False},
        "train": {"updates_per_step": 1}, "rollout": {"engine": "local"}})
    spec, _ = model_architecture(cfg.model.path)
    (stage,) = trainer_memory(cfg, spec, trainer_layout(cfg, spec, gpus=1))
    return stage


@contextmanager
def transformer_config_with(flags: dict[str, bool]):
    """The policy built with megatron-core's TransformerConfig `flags` set over what policy/model.py chooses."""
    from megatron_dapo.policy import model

    chosen = model.transformer_config
    model.transformer_config = lambda *a, **k: dataclasses.replace(chosen(*a, **k), **flags)
    try:
        yield
    finally:
        model.transformer_config = chosen


@dataclasses.dataclass
class Measured:
    step_s: float  # median over the measured steps
    parts: dict[str, float]  # seconds per step
    peak_bytes: int | None  # the device allocator's peak over the measured steps; None on the CPU
    state_bytes: int | None  # allocated after the warm-up step: weights, gradients, optimizer state


def measure(rank, args, samples, flags: dict[str, bool] | None = None) -> Measured:
    """A fresh PolicyTrainer (with `flags` over the model's TransformerConfig), a warm-up step, then args.steps
    timed steps on `samples`; the trainer is freed before returning."""
    from megatron_dapo.config import LossConfig, OptimConfig
    from megatron_dapo.policy import train_step
    from megatron_dapo.policy.train_step import PolicyTrainer

    device = rank.device
    cuda = device.type == "cuda" and torch.cuda.is_available()
    with transformer_config_with(flags or {}):
        trainer = PolicyTrainer(rank.spec, rank.parallel, device,
                                OptimConfig(lr=1e-6, warmup_steps=0, distributed_optimizer=False), LossConfig(),
                                args.micro_batch_tokens, params_dtype=rank.dtype)
    split = Split(device)
    try:
        with (split.timing(train_step, "model_forward", "forward"),
              split.timing(trainer, "_loss_func", "log-probs + loss"),
              split.timing(trainer.optimizer, "step", "optimizer")):
            trainer.step(samples)  # warm-up: allocations, kernels' first calls, compiled fusions
            state = torch.cuda.memory_allocated(device) if cuda else None
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            split.seconds.clear()
            totals = []
            for _ in range(args.steps):
                with split.part("step"):
                    trainer.step(samples)
                totals.append(split.seconds.pop("step"))
    finally:
        del trainer
        gc.collect()
    step_s = statistics.median(totals)
    parts = {k: v / args.steps for k, v in split.seconds.items()}
    parts["backward + reduction"] = step_s - sum(parts.values())
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    if cuda:
        torch.cuda.empty_cache()
    return Measured(step_s, parts, peak, state)


def compare_fusions(rank, args, samples, tokens: int) -> None:
    """Each fusion alone over the shipped step, each followed by a shipped step of its own to compare it with; a
    row is printed as soon as it is measured (a first torch.compile on a cold cache can take a while: what was
    measured before a time limit stays in the log)."""
    print(f"\n== fusions: each alone over the step as shipped (policy/model.py), a fresh model each; step time "
          f"median of {args.steps}; ratio < 1 is faster ==")
    print(f"{'fusion':<30} {'shipped s':>10} {'fused s':>10} {'fused/shipped':>14} {'tokens/s fused':>15} "
          f"{'peak GB shipped':>16} {'peak GB fused':>14}  note", flush=True)
    for flag in FUSIONS:
        try:
            fused = measure(rank, args, samples, {flag: True})
        except Exception as error:  # noqa: BLE001 -- a fusion this machine lacks: its row says why
            note = str(error).strip().splitlines()[0][:110]
            print(f"{flag:<30} {'-':>10} {'-':>10} {'-':>14} {'-':>15} {'-':>16} {'-':>14}  unavailable: {note}",
                  flush=True)
            continue
        shipped = measure(rank, args, samples)
        peaks = [f"{m.peak_bytes / 1e9:.2f}" if m.peak_bytes is not None else "n/a" for m in (shipped, fused)]
        print(f"{flag:<30} {shipped.step_s:>10.4f} {fused.step_s:>10.4f} {fused.step_s / shipped.step_s:>14.3f} "
              f"{tokens / fused.step_s:>15.0f} {peaks[0]:>16} {peaks[1]:>14}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model of the same shape (the suite)")
    parser.add_argument("--tokens", type=int, default=32768, help="tokens per step (prompts and responses)")
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3, help="measured steps, after one warm-up step")
    parser.add_argument("--gemm-n", type=int, default=8192)
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak (default: by its name)")
    parser.add_argument("--fusions", action="store_true",
                        help="instead: the step with each of megatron-core's fusions against the step as shipped")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0

    from megatron_dapo.parallel.runtime import shutdown_runtime

    rank = one_rank(args.device, args.tiny, "bench_train_step_")
    spec, device, dtype = rank.spec, rank.device, rank.dtype
    shape = lengths(args.tokens, args.micro_batch_tokens, seed=0)
    samples = batch(spec, shape, seed=0)
    tokens = sum(p + r for p, r in shape)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" and torch.cuda.is_available() else "cpu"
    print(f"\n== train step: {'tiny ' if args.tiny else ''}Qwen2.5-1.5B shape, {spec.num_layers} layers, "
          f"{str(dtype).removeprefix('torch.')}, {name}; {len(shape)} sequences, {tokens} tokens in micro-batches of "
          f"{args.micro_batch_tokens}; median of {args.steps} steps ==")
    if args.fusions:
        compare_fusions(rank, args, samples, tokens)
        shutdown_runtime()
        return 0
    run = measure(rank, args, samples)
    cuda = run.peak_bytes is not None
    tflops = step_flops(spec, shape) / run.step_s / 1e12
    gemm_n = args.gemm_n if not args.tiny else 256
    gemm = gemm_tflops(gemm_n, device if cuda else torch.device("cpu"), dtype if cuda else torch.float32)
    peak = args.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    estimate = preflight_memory(rank.folder, "cuda" if cuda else args.device, args)
    shutdown_runtime()

    print(f"step s          {run.step_s:.3f}")
    print(f"tokens/s        {tokens / run.step_s:.0f}")
    print(f"model TFLOP/s   {tflops:.2f} (attention counted causal, half the square)")
    print(f"GEMM TFLOP/s    {gemm:.2f} (n = {gemm_n}, measured in this run)")
    print(f"MFU vs GEMM     {100 * tflops / gemm:.1f} %")
    print(f"MFU vs peak     {f'{100 * tflops / peak:.1f} % of {peak:g} TFLOP/s' if peak else 'n/a (--peak-tflops)'}")
    for part, seconds in run.parts.items():
        print(f"time {part:<20} {seconds:.4f} s  {100 * seconds / run.step_s:5.1f} %")
    if cuda:
        print(f"peak memory     {run.peak_bytes / 1e9:.2f} GB measured, {estimate.total / 1e9:.2f} GB preflight: "
              f"estimate / measured {estimate.total / run.peak_bytes:.2f}")
        print(f"between steps   {run.state_bytes / 1e9:.2f} GB measured, {estimate.state / 1e9:.2f} GB preflight "
              f"(weights + grads + optimizer): estimate / measured {estimate.state / run.state_bytes:.2f}")
    else:
        print(f"peak memory     n/a on the CPU (no device allocator); preflight {estimate.total / 1e9:.3f} GB")
        print("between steps   n/a on the CPU (no device allocator)")
    print("preflight parts " + ", ".join(f"{part} {getattr(estimate, part) / 1e9:.4g} GB" for part in
                                         ("weights", "grads", "optimizer", "activations", "logits")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
