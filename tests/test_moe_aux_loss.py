"""Issue 50, finding 1: the load-balancing loss's gradient does not depend on the loss's aggregation, on where the
prompt ends, on how many responses are in the loss, on padding, or on the micro-batch split. megatron-core (per-token
loss mode) scaled the aux loss by the tokens a micro-batch routes, padding included, and the step then divides every
gradient by the loss's units (response tokens, or responses under loss.aggregation "sample"): the aux loss's strength
followed those units (24x under "sample"). The policy-gradient term is zero here (advantages 0), so the step's change
is the aux loss's alone.

One rank in this process (the split invariance over ranks is test_moe.py's). A first Adam step with lr = eps = 1e3 is
minus the gradient."""

import sys
from pathlib import Path

import pytest
import torch
from conftest import one_process_runtime

sys.path.insert(0, str(Path(__file__).parent / "distributed"))
from tiny_models import PARITY_DTYPE, VOCAB, hf_model  # noqa: E402

from megatron_dapo.config import LossConfig, OptimConfig, ParallelConfig  # noqa: E402
from megatron_dapo.policy.batch import Sequence  # noqa: E402
from megatron_dapo.policy.train_step import PolicyTrainer, RolloutSample  # noqa: E402

PROMPT, RESPONSE, DISTINCT = 6, 10, 4
COEF = 0.01


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from megatron_dapo.checkpoint.safetensors_io import HFCheckpoint
    from megatron_dapo.parallel.runtime import shutdown_runtime
    from megatron_dapo.policy.hf_config import model_spec_from_hf

    parallel = ParallelConfig(device="cpu")
    runtime = one_process_runtime(parallel)
    folder = tmp_path_factory.mktemp("qwen3_moe")
    hf_model("qwen3_moe")[0].save_pretrained(folder)
    ckpt = HFCheckpoint(folder)
    yield model_spec_from_hf(ckpt.config), ckpt.get, parallel, runtime
    shutdown_runtime()


def tokens() -> list[torch.Tensor]:
    """DISTINCT sequences of one length, twice over: split in two micro-batches, each holds the same tokens."""
    g = torch.Generator().manual_seed(3)
    distinct = [torch.randint(0, VOCAB, (PROMPT + RESPONSE,), generator=g) for _ in range(DISTINCT)]
    return distinct + distinct


def samples(prompt_len: int = PROMPT, in_loss: int = 2 * DISTINCT) -> list[RolloutSample]:
    """Advantages 0; the first `in_loss` responses in the loss (the others as a filtered group's: no loss token)."""
    out = []
    for i, t in enumerate(tokens()):
        n = t.numel() - prompt_len
        mask = torch.full((n,), i < in_loss)
        out.append(RolloutSample(Sequence(t, prompt_len), torch.full((n,), -2.0), torch.zeros(n), mask))
    return out


def aux_step(moe, batch: list[RolloutSample], aggregation: str = "token", max_tokens: int = 100_000,
             packed: bool = False, recompute: bool = False):
    """Every weight's change in one step, and the step's result."""
    from megatron_dapo.checkpoint.hf_weights import load_policy_weights

    spec, get, parallel, runtime = moe
    optim = OptimConfig(lr=1e3, adam_eps=1e3, warmup_steps=0, weight_decay=0.0, clip_grad=0.0)
    trainer = PolicyTrainer(spec, parallel, runtime.device, optim, LossConfig(aggregation=aggregation), max_tokens,
                            params_dtype=PARITY_DTYPE, moe_aux_loss_coef=COEF, packed=packed,
                            activation_recompute="full" if recompute else "none")
    load_policy_weights(trainer, get)
    before = {n: p.detach().clone() for n, p in trainer.module.named_parameters()}
    result = trainer.step(batch)
    change = {n: p.detach() - before[n] for n, p in trainer.module.named_parameters()}
    return change, result


CASES = {"loss.aggregation sample": dict(aggregation="sample"),
         "the prompt two tokens longer": dict(batch=dict(prompt_len=PROMPT + 2)),
         "half the responses out of the loss": dict(batch=dict(in_loss=DISTINCT)),
         "two micro-batches": dict(max_tokens=DISTINCT * (PROMPT + RESPONSE)),
         # each layer's forward runs again in the backward (the loss counted once, in the one with a graph)
         "two micro-batches, activation recompute": dict(max_tokens=DISTINCT * (PROMPT + RESPONSE), recompute=True)}


@pytest.fixture(scope="module")
def base(moe):
    return aux_step(moe, samples())


@pytest.mark.parametrize("case", list(CASES))
def test_the_load_balancing_gradient_is_the_same_whatever_the_loss_units_and_the_split(moe, base, case):
    base_change, base_result = base
    routers = [n for n in base_change if n.endswith("router.weight")]
    assert routers and all(base_change[n].abs().max() > 0 for n in routers), "the aux loss moved no router"
    assert base_result.loss == 0.0  # advantages 0: the change is the aux loss's alone
    settings = dict(CASES[case])
    change, result = aux_step(moe, samples(**settings.pop("batch", {})), **settings)
    assert result.load_balancing_loss == pytest.approx(base_result.load_balancing_loss, rel=1e-6)
    scale = max(v.abs().max().item() for v in base_change.values())
    worst = max((change[n] - base_change[n]).abs().max().item() for n in base_change) / scale
    ratio = sum(change[n].norm() for n in routers) / sum(base_change[n].norm() for n in routers)
    assert worst < 1e-5, f"{case}: the aux loss's step differs by {worst:.2e} (relative); routers' change x{ratio:.3f}"


def test_padding_is_not_in_the_load_balancing_loss(moe):
    """Sequences of other lengths in one micro-batch: packed (end to end, no padding) or a padded block (padding
    after each shorter one) hold the same real tokens, so the same switch loss and the same step. megatron-core
    counted the padding as routed tokens (measured before: the padded step's routers' change x1.44 the packed one's,
    its loss's value x1.11)."""
    g = torch.Generator().manual_seed(4)
    batch = []
    for n in (9, 16, 23, 12):
        t = torch.randint(0, VOCAB, (n,), generator=g)
        r = n - PROMPT
        batch.append(RolloutSample(Sequence(t, PROMPT), torch.full((r,), -2.0), torch.zeros(r), torch.ones(r).bool()))
    packed_change, packed = aux_step(moe, batch, packed=True)
    padded_change, padded = aux_step(moe, batch)
    routers = [n for n in packed_change if n.endswith("router.weight")]
    ratio = sum(padded_change[n].norm() for n in routers) / sum(packed_change[n].norm() for n in routers)
    print(f"padded / packed: routers' change x{ratio:.3f}, "
          f"loss x{padded.load_balancing_loss / packed.load_balancing_loss:.3f}")
    assert padded.load_balancing_loss == pytest.approx(packed.load_balancing_loss, rel=1e-6)
    scale = max(v.abs().max().item() for v in packed_change.values())
    worst = max((padded_change[n] - packed_change[n]).abs().max().item() for n in packed_change) / scale
    assert worst < 1e-5, f"the padded block's aux step differs by {worst:.2e} (relative); routers' change x{ratio:.3f}"

