"""Routing replay, measured: a tiny Qwen3-MoE samples with the in-process engine (its own routing, recorded), and
the trainer recomputes the log-probs of those samples and takes a training step, with replay off (its own routing)
and on (the engine's routes), side by side in one run. In bf16 and the device-faithful mode by default, as the suite
runs; what it prints:

- routes differ: the fraction of response tokens where the trainer's routers, by their own scores, would choose
  other experts than the engine recorded, in at least one MoE layer (with replay the routers take the engine's
  routes, but their own choice is still measured: what they were told is no reference for itself);
- |log ratio|: the mean |log pi_trainer - log pi_engine| over response tokens;
- step s: one training step (recompute excluded), the median of --steps;
- and the ratios on / off.

    python bench/bench_routing_replay.py [--prompts 16] [--group 4] [--max-new-tokens 48] [--experts 8] [--topk 2]
                                         [--layers 4] [--steps 3] [--dtype bfloat16] [--plain] [--shift 0]

--shift N: a control, the engine's recorded routes N tokens late (as an engine or a layout that misaligns them would
give), replayed and compared as they are: a comparison of the replayed routes with the record would still read 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def tiny_moe(folder: Path, experts: int, topk: int, layers: int, seed: int = 0) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=256,
                         num_experts=experts, num_experts_per_tok=topk, moe_intermediate_size=32, norm_topk_prob=True,
                         router_aux_loss_coef=0.0, eos_token_id=0, architectures=["Qwen3MoeForCausalLM"])
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # routers at the spread a trained model's have (zeros at init: every token tied)
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.3)
    model.save_pretrained(folder)


def routes_of(model, seq, spec, kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs of the response, the experts the model's routers would choose by their own scores at every
    position, replayed or not) for one sequence."""
    from megatron_dapo.policy.forward import response_logprobs
    from megatron_dapo.policy.routing_replay import routers_of

    own = []

    def choice(router, args, _):
        logits = router.gating(args[0]).reshape(-1, spec.num_experts)
        own.append(logits.topk(spec.moe_topk).indices.sort().values)

    hooks = [r.register_forward_hook(choice) for r in routers_of(model)]
    try:
        [(logp, _)] = response_logprobs(model, [seq], **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return logp.double().cpu(), torch.stack(own, 1).cpu()


def measure(args) -> list[tuple[str, float, float, float]]:
    from megatron_dapo.checkpoint.hf_weights import load_hf_weights, load_policy_weights
    from megatron_dapo.checkpoint.safetensors_io import HFCheckpoint
    from megatron_dapo.config import LossConfig, OptimConfig, ParallelConfig
    from megatron_dapo.parallel.runtime import free_port, init_runtime, shutdown_runtime
    from megatron_dapo.policy.batch import Sequence
    from megatron_dapo.policy.hf_config import model_spec_from_hf
    from megatron_dapo.policy.model import build_model
    from megatron_dapo.policy.train_step import PolicyTrainer, RolloutSample
    from megatron_dapo.rollout.engine import SamplingParams
    from megatron_dapo.rollout.local_engine import LocalEngine

    dtype = getattr(torch, args.dtype)
    folder = Path(tempfile.mkdtemp(prefix="bench_replay_")) / "moe"
    tiny_moe(folder, args.experts, args.topk, args.layers)
    ckpt = HFCheckpoint(folder)
    spec = model_spec_from_hf(ckpt.config)
    parallel = ParallelConfig(device="cpu")
    runtime = init_runtime(parallel, environ={"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                                              "MASTER_PORT": str(free_port())})
    try:
        sampler = build_model(spec, parallel, pre_process=True, post_process=True, params_dtype=dtype)
        load_hf_weights(sampler, ckpt.get, spec, parallel)
        engine = LocalEngine(sampler, vocab_size=spec.vocab_size, max_positions=spec.max_position_embeddings,
                             eos_token_ids=[0], device=runtime.device, seed=1, record_routes=True)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1, spec.vocab_size, (int(n),), generator=g).tolist()
                   for n in torch.randint(4, 24, (args.prompts,), generator=g)]
        groups = engine.generate(prompts, args.group, SamplingParams(max_new_tokens=args.max_new_tokens))
        samples = [s for grp in groups for s in grp]
        recorded = [torch.from_numpy(s.routes).long().roll(args.shift, 0) for s in samples]
        engine_logp = [torch.tensor(s.logprobs, dtype=torch.float64) for s in samples]
        kwargs = dict(vocab_size=spec.vocab_size, max_positions=spec.max_position_embeddings,
                      max_tokens_per_micro_batch=4096, device=runtime.device)
        rows = []
        for replay in (False, True):
            trainer = PolicyTrainer(spec, parallel, runtime.device, OptimConfig(lr=1e-5, warmup_steps=0),
                                    LossConfig(), 4096, params_dtype=dtype, moe_aux_loss_coef=0.0,
                                    routing_replay=replay)
            load_policy_weights(trainer, ckpt.get)
            model = trainer.module.eval()
            seqs = [Sequence(torch.tensor(prompts[s.prompt_index] + s.output_ids), len(prompts[s.prompt_index]),
                             r if replay else None) for s, r in zip(samples, recorded)]
            differ = tokens = 0
            abs_log_ratio = 0.0
            for seq, s, r, elp in zip(seqs, samples, recorded, engine_logp):
                logp, chosen = routes_of(model, seq, spec, kwargs)
                p = seq.prompt_len
                # the positions that predict the response's tokens, against what the engine recorded there
                mine, theirs = chosen[p - 1: r.shape[0]], r[p - 1:].sort().values
                differ += int((mine != theirs).flatten(1).any(1).sum())
                tokens += len(s.output_ids)
                abs_log_ratio += float((logp - elp).abs().sum())
            model.train()
            batch = [RolloutSample(seq, elp.float(), torch.full((len(elp),), 1.0 if i % 2 else -1.0),
                                   torch.ones(len(elp), dtype=torch.bool))
                     for i, (seq, elp) in enumerate(zip(seqs, engine_logp))]
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                trainer.step(batch)
                times.append(time.perf_counter() - start)
            rows.append(("on" if replay else "off", differ / tokens, abs_log_ratio / tokens,
                         statistics.median(times)))
            del trainer
        return rows
    finally:
        shutdown_runtime()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--plain", action="store_true", help="plain CPU mode, not device-faithful")
    parser.add_argument("--shift", type=int, default=0, help="a control: the engine's recorded routes this many tokens late")
    args = parser.parse_args(argv)
    if not args.plain:  # before the runtime starts: the suite's mode
        os.environ.setdefault("MEGATRON_DAPO_DEVICE_FAITHFUL", "1")
    rows = measure(args)
    print(f"tiny Qwen3-MoE: {args.layers} layers, {args.experts} experts, top {args.topk}, {args.dtype}; "
          f"{args.prompts} prompts x {args.group} responses of up to {args.max_new_tokens} tokens"
          + (f"; the engine's routes recorded {args.shift} token(s) late" if args.shift else ""))
    print(f"{'replay':<8}{'routes differ':>15}{'|log ratio|':>14}{'step s':>10}")
    for name, differ, ratio, step in rows:
        print(f"{name:<8}{differ:>15.4f}{ratio:>14.2e}{step:>10.3f}")
    (_, d_off, r_off, s_off), (_, d_on, r_on, s_on) = rows
    print(f"on / off: routes differ {d_on:.4f} vs {d_off:.4f}; |log ratio| {r_on / r_off:.2f}x; "
          f"step time {s_on / s_off:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
