"""Logits only where the loss needs them (policy/output_positions.py): the output layer runs on the positions that
predict response tokens, and the log-probs, the loss and every gradient are those of the full logits (one gloo
process, fp32, padded and packed micro-batches). At TP = 2 with sequence parallelism the same step comes out of
tests/test_policy_training.py's split invariance."""

import sys
from pathlib import Path

import pytest
import torch
from conftest import one_process_runtime

sys.path.insert(0, str(Path(__file__).parent / "distributed"))
from tiny_models import PARITY_DTYPE, hf_model, sequences  # noqa: E402

from megatron_dapo.config import ParallelConfig  # noqa: E402
from megatron_dapo.policy.batch import micro_batches  # noqa: E402


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    from megatron_dapo.checkpoint.hf_weights import load_hf_weights
    from megatron_dapo.checkpoint.safetensors_io import HFCheckpoint
    from megatron_dapo.parallel.runtime import shutdown_runtime
    from megatron_dapo.policy.hf_config import model_spec_from_hf
    from megatron_dapo.policy.model import build_model

    parallel = ParallelConfig(device="cpu")
    runtime = one_process_runtime(parallel)
    folder = tmp_path_factory.mktemp("qwen2")
    hf_model("qwen2")[0].save_pretrained(folder)
    ckpt = HFCheckpoint(folder)
    spec = model_spec_from_hf(ckpt.config)
    model = build_model(spec, parallel, pre_process=True, post_process=True, params_dtype=PARITY_DTYPE)
    load_hf_weights(model, ckpt.get, spec, parallel)
    yield model, spec, runtime.device
    shutdown_runtime()


def loss_and_grads(model, loss_of):
    model.zero_grad(set_to_none=True)
    loss = loss_of()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("packed", [False, True])
def test_logits_at_response_positions_give_the_full_logits_loss_and_gradients(policy, packed):
    from megatron_dapo.policy.forward import micro_batch_logprobs, model_forward
    from megatron_dapo.policy.logprobs import vocab_parallel_logprobs

    model, spec, device = policy
    seqs = sequences(seed=4)
    (mb,) = micro_batches(seqs, 100000, packed=packed)
    weights = torch.randn(mb.num_response_tokens, generator=torch.Generator().manual_seed(0)).to(device)

    def picked():
        logits = model_forward(model, mb, device)
        assert logits.shape[:2] == (1, mb.num_response_tokens)  # no prompt or padding row computed
        logp, _ = micro_batch_logprobs(logits, mb, spec.vocab_size, inplace_backward=True)
        return (logp * weights).sum()

    def full():  # the model called directly: every position's logits
        ids = mb.input_ids.to(device)
        if packed:  # the full logits of each sequence alone, in the pack's order
            logits = torch.cat([model(s.tokens[None].to(device), torch.arange(len(s.tokens), device=device)[None],
                                      None)[0] for s in (seqs[i] for i in mb.sample_index)])
        else:
            logits = model(ids, torch.arange(ids.shape[1], device=device).expand_as(ids), None)
        logp, _ = vocab_parallel_logprobs(logits.reshape(-1, logits.shape[-1]), mb.targets.to(device), vocab_start=0,
                                          vocab_size=spec.vocab_size)
        return (logp[mb.response_positions.to(device)] * weights).sum()

    loss_a, grads_a = loss_and_grads(model, picked)
    loss_b, grads_b = loss_and_grads(model, full)
    assert loss_a.item() == pytest.approx(loss_b.item(), rel=1e-6)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 10
    scale = max(g.abs().max().item() for g in grads_b.values())
    assert max((grads_a[k] - grads_b[k]).abs().max().item() for k in grads_b) < 1e-5 * scale


def test_the_rows_computed_are_at_least_one_per_rank_and_divide_under_sequence_parallelism():
    from megatron_dapo.policy.output_positions import rows_computed

    assert [rows_computed(n, 1, False) for n in (0, 1, 7)] == [1, 1, 7]
    assert [rows_computed(n, 4, True) for n in (0, 1, 7, 8)] == [4, 4, 8, 8]
    assert rows_computed(7, 4, False) == 7
