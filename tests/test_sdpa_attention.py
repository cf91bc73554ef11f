"""SdpaAttention (the local spec's core attention) against megatron-core's DotProductAttention and transformers:
in-process at TP = 1 (gloo world of one), under torchrun at TP = 2."""

import json
import sys
from pathlib import Path

import pytest
import torch
from torchrun_launch import torchrun

sys.path.insert(0, str(Path(__file__).parent / "distributed"))
from sdpa_attention_worker import (  # noqa: E402
    attention_config,
    attention_errors,
    attention_pair,
    model_errors,
    random_qkv,
    run_attention,
)

from megatron_dapo.config import ParallelConfig  # noqa: E402

TOL = 1e-5


@pytest.fixture(scope="module")
def runtime():
    from megatron_dapo.parallel.runtime import free_port, init_runtime, shutdown_runtime

    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    yield init_runtime(ParallelConfig(device="cpu"), environ=env)
    shutdown_runtime()


@pytest.mark.parametrize("softmax_scale", [None, 0.3])
def test_causal_gqa_matches_megatron(runtime, softmax_scale):
    errors = attention_errors(runtime.device, softmax_scale=softmax_scale)
    assert errors["output"] < TOL and errors["grad"] < TOL, errors


def test_decoding_one_query_against_a_longer_kv_cache(runtime):
    # sq == 1 against the cache (no mask) equals megatron's, and the last row of causal attention over all keys.
    assert max(attention_errors(runtime.device, sq=1, sk=9).values()) < TOL
    q, k, v, w = random_qkv(9, 9)
    _, sdpa = attention_pair(attention_config(1))
    full, _ = run_attention(sdpa, q, k, v, w, runtime.device)
    last, _ = run_attention(sdpa, q[-1:], k, v, w[-1:], runtime.device)
    assert (last - full[-1:]).abs().max().item() < TOL


def test_an_explicit_mask_matches_megatron(runtime):
    # megatron's convention: True where attention is NOT allowed. Causal plus padded keys, every row keeps a key.
    sq = 12
    mask = torch.ones(sq, sq, dtype=torch.bool).triu(1).repeat(2, 1, 1, 1)  # [b, 1, sq, sk]
    mask[1, :, :, 9:] = True
    errors = attention_errors(runtime.device, sq=sq, mask=mask)
    assert errors["output"] < TOL and errors["grad"] < TOL, errors


def test_the_local_spec_model_uses_sdpa_and_matches_transformers_and_megatron(runtime):
    errors = model_errors("qwen3", runtime.parallel, runtime)  # q/k norm, head_dim != hidden / heads
    assert max(errors.values()) < TOL, errors


def test_what_it_cannot_match_is_refused(runtime):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dapo.policy.sdpa_attention import SdpaAttention

    _, sdpa = attention_pair(attention_config(1))
    q, k, v, _ = (t.to(runtime.device) for t in random_qkv(3, 5))
    with pytest.raises(ValueError, match="causal attention needs as many queries as keys or a single query"):
        sdpa(q, k, v, None)
    with pytest.raises(ValueError, match="does not support qkv_format=None"):  # packs: thd (tests/test_packing.py)
        sdpa(q, k, v, None, packed_seq_params=PackedSeqParams())
    with pytest.raises(ValueError, match="attention dropout 0.1"):
        SdpaAttention(attention_config(1, attention_dropout=0.1), 1, AttnMaskType.causal, "self")
    with pytest.raises(ValueError, match="sliding-window"):
        SdpaAttention(attention_config(1, window_size=(8, 0)), 1, AttnMaskType.causal, "self")


@pytest.mark.slow
def test_tensor_parallel_2_matches_megatron_and_transformers(tmp_path):
    torchrun("sdpa_attention_worker.py", 2, str(tmp_path))
    results = {}
    for f in sorted(tmp_path.glob("rank*.json")):
        results.update(json.loads(f.read_text()))
    expected = [f"{case}-tp2-rank{r}" for case in ("attention", "model-qwen2", "model-qwen3") for r in (0, 1)]
    assert sorted(results) == sorted(expected)
    for case, errors in results.items():
        assert max(errors.values()) < TOL, (case, errors)
