"""The Megatron policy on one GPU (NCCL, bf16, Transformer Engine layers when installed) against transformers:
a dense Qwen2 and a Qwen3-MoE with experts in every layer (EP = 1; megatron-core's SequentialMLP experts without
Transformer Engine, its grouped experts with it).

Its bf16 log-probs are held to transformers' fp32 ones of the same model within a few times the error of
transformers' own bf16 run (with a floor); `-s` shows the figures (tests/gpu/run.sh puts them in its table)."""

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

# The policy's bf16 log-probs may be off transformers' fp32 ones by BF16_FACTOR x what transformers' own bf16
# run is off (about 3e-3 for this model), and by BF16_FLOOR in any case.
BF16_FACTOR, BF16_FLOOR = 4.0, 0.02


@pytest.fixture(scope="module")
def runtime():
    from megatron_dapo.config import ParallelConfig
    from megatron_dapo.parallel.runtime import free_port, init_runtime, shutdown_runtime

    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    parallel = ParallelConfig(device="cuda")
    rt = init_runtime(parallel, environ=env)
    yield rt
    shutdown_runtime()


@pytest.mark.parametrize("kind", ["qwen2", "qwen3_moe_sparse"])
def test_bf16_logprobs_and_a_training_step(runtime, kind):
    from tiny_models import hf_model, hf_response_logprobs, sequences

    from megatron_dapo.checkpoint.hf_weights import load_policy_weights
    from megatron_dapo.policy.forward import response_logprobs
    from megatron_dapo.policy.hf_config import model_spec_from_hf
    from megatron_dapo.policy.train_step import LossConfig, OptimConfig, PolicyTrainer, RolloutSample

    hf, cfg = hf_model(kind)
    spec = model_spec_from_hf(cfg)
    trainer = PolicyTrainer(spec, runtime.parallel, runtime.device, OptimConfig(lr=1e-3, warmup_steps=0),
                            LossConfig(), max_tokens_per_micro_batch=130)
    load_policy_weights(trainer, hf.state_dict().__getitem__)
    assert trainer.module.config.params_dtype == torch.bfloat16
    seqs = sequences()
    ref = hf_response_logprobs(hf, seqs)
    hf_bf16 = hf_cuda_logprobs(copy.deepcopy(hf).to(runtime.device, torch.bfloat16), seqs, runtime.device)
    out = response_logprobs(trainer.module, seqs, vocab_size=spec.vocab_size, max_positions=96,
                            max_tokens_per_micro_batch=130, device=runtime.device)
    worst = max((o[0].double().cpu() - r[0]).abs().max().item() for o, r in zip(out, ref))
    hf_worst = max((h - r[0]).abs().max().item() for h, r in zip(hf_bf16, ref))
    bound = max(BF16_FLOOR, BF16_FACTOR * hf_worst)
    print(f"\nfigures: {kind} bf16 max |logp - transformers fp32| {worst:.2g} (transformers bf16: {hf_worst:.2g}; "
          f"bound {bound:.2g})")
    assert worst < bound, f"bf16 log-probs off by {worst}; transformers' own bf16 run is off by {hf_worst}"
    samples = [RolloutSample(s, o[0].float().cpu(), torch.full((s.response_len,), 1.0 if i % 2 else -1.0),
                             torch.ones(s.response_len, dtype=torch.bool)) for i, (s, o) in enumerate(zip(seqs, out))]
    losses = [trainer.step(samples).loss for _ in range(4)]
    print(f"figures: {kind} loss over 4 bf16 steps {losses[0]:.4g} -> {losses[-1]:.4g}")
    assert losses[-1] < losses[0], losses


@torch.no_grad()
def hf_cuda_logprobs(model, seqs, device):
    """transformers' response-token log-probs (fp64, on the host) from `model` as it is (dtype, device)."""
    out = []
    for s in seqs:
        logp = torch.log_softmax(model(s.tokens[None].to(device)).logits[0].double(), dim=-1)
        out.append(logp[s.prompt_len - 1:-1].gather(1, s.tokens[s.prompt_len:, None].to(device)).squeeze(1).cpu())
    return out
