"""A kept batch's responses -> training samples on the rank's device (old log-probs on every pipeline stage,
the rollout correction's weights, the KL reference), and the mismatch metrics reduced over the world, under
torchrun. At the same split policies, the in-process engine refuses to sample (it needs TP = PP = CP = 1)."""

import json

import pytest
from torchrun_launch import torchrun

pytestmark = pytest.mark.slow
# tp,pp,cp,packed,max_tokens_per_micro_batch: padded blocks of up to 100 tokens (the responses in 3 micro-batches)
# split over pipeline stages or tensor ranks; packed micro-batches of up to 64 tokens split over 2 CP ranks.
LAYOUTS = {"tp1-pp2-cp1": "1,2,1,0,100", "tp2-pp1-cp1": "2,1,1,0,100", "tp1-pp1-cp2": "1,1,2,1,64"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("rollout_samples")
    torchrun("rollout_samples_worker.py", 2, str(out), *LAYOUTS.values())
    return {name: json.loads((out / f"{name}.json").read_text()) for name in LAYOUTS}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_samples_live_on_the_device_with_the_policys_logprobs(runs, layout):
    r = runs[layout]
    assert r["on_device"]
    assert r["old_logp_err"] < 1e-4 and r["ref_logp_err"] < 1e-4
    assert r["dtypes"] == ["torch.bool", "torch.float32"]  # the loss tokens; their TIS weights
    assert r["left_out_masked"]  # an overlong-filtered response


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mismatch_metrics_count_every_loss_token_once(runs, layout):
    got, want = runs[layout]["metrics"], runs[layout]["expected"]
    for key in ("tokens", "sequences", "masked_tokens", "masked_sequences"):
        assert got[key] == want[key], key
    for key in ("entropy_sum", "mismatch_k3_sum", "mismatch_abs_sum", "token_ratio_sum", "token_ratio_sq_sum",
                "seq_ratio_sum", "seq_log_ratio_sum", "seq_log_ratio_sq_sum", "weight_sum", "abs_max",
                "token_ratio_max", "seq_ratio_max"):
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    assert abs(got["reference_k3_sum"]) < 1e-6  # the reference has the policy's weights here


@pytest.mark.parametrize("layout", LAYOUTS)
def test_with_the_engines_logprobs_as_pi_old_the_kl_references_distance_is_still_summed(runs, layout):
    """loss.old_logprobs "rollout" recomputes nothing, so there is no entropy or mismatch to sum; the KL term's
    reference is still there, and so is its distance from pi_old (the kl_reference metric of GRPO's runs with the
    in-process engine)."""
    got, want = runs[layout]["rollout_metrics"], runs[layout]["expected"]
    assert got["tokens"] == want["tokens"]
    assert got["reference_k3_sum"] == pytest.approx(want["rollout_reference_k3_sum"], rel=1e-3)
    assert got["reference_k3_sum"] > 1e-3  # the engine's log-probs are 0.05-noisy: the distance is not 0
    assert got["entropy_sum"] == got["mismatch_k3_sum"] == got["abs_max"] == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_in_process_engine_refuses_a_split_policy_naming_the_engine_to_use(runs, layout):
    tp, pp, cp = (int(part[2:]) for part in layout.split("-"))
    message = runs[layout]["local_engine_refusal"]
    assert "rollout.engine" in message and f"TP={tp} x PP={pp} x CP={cp}" in message and "'sglang'" in message, message


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_corrections_weights_are_the_unsplit_responses_whatever_the_layout(runs, layout):
    """Issue 52: a response's sequence-level (and geometric) weight needs all its tokens. Split over pipeline
    stages, tensor ranks, 2 CP ranks, packed or padded micro-batches, each loss token gets the weight the host
    computes from the whole response (ops/rollout_correction_reference.py over transformers' log-probs), and the
    bands leave some out."""
    got = runs[layout]
    for name, err in got["weight_err"].items():
        assert err < 1e-4, (name, err)
    assert 0 < got["masked"]["sequence_mask"] < 138 and 0 < got["masked"]["geometric_reject"] < 138, got["masked"]
