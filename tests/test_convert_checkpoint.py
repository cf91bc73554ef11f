"""tools/convert_checkpoint.py: HF <-> megatron-core distributed checkpoints at TP=2 x PP=2, for real."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchrun_launch import torchrun

sys.path.insert(0, str(Path(__file__).parent / "distributed"))
from tiny_models import hf_model  # noqa: E402

from megatron_dapo.checkpoint.convert import hf_to_mcore, mcore_to_hf  # noqa: E402
from megatron_dapo.checkpoint.hf_mapping import MappingError  # noqa: E402
from megatron_dapo.checkpoint.safetensors_io import CheckpointError, HFCheckpoint  # noqa: E402
from megatron_dapo.config import ConfigError  # noqa: E402

pytestmark = pytest.mark.slow
TOOL = Path(__file__).parents[1] / "tools" / "convert_checkpoint.py"


@pytest.fixture(scope="module", params=["qwen2_tied", "qwen2", "llama"])
def converted(request, tmp_path_factory):
    kind = request.param
    root = tmp_path_factory.mktemp(f"convert_{kind}")
    model, _ = hf_model(kind)
    model.save_pretrained(root / "hf", max_shard_size="60KB")
    (root / "hf" / "tokenizer_config.json").write_text('{"model_max_length": 96}')
    # One direction through the command-line tool, the other through the API.
    subprocess.run([sys.executable, str(TOOL), "hf-to-mcore", "--input", str(root / "hf"), "--output",
                    str(root / "mcore"), "--tp", "2", "--pp", "2"], check=True, capture_output=True, text=True)
    mcore_to_hf(root / "mcore", root / "back", max_shard_bytes=100_000)
    return kind, root


def test_round_trip_is_bitwise_identical(converted):
    _, root = converted
    src, back = HFCheckpoint(root / "hf"), HFCheckpoint(root / "back")
    assert sorted(back.names()) == sorted(src.names())
    for name in src.names():
        assert torch.equal(back.get(name), src.get(name)), name
    assert back.config == src.config
    assert (root / "back" / "tokenizer_config.json").read_text() == '{"model_max_length": 96}'
    meta = json.loads((root / "mcore" / "megatron_dapo.json").read_text())
    assert (meta["tensor_parallel"], meta["pipeline_parallel"]) == (2, 2)


def test_transformers_loads_the_result(converted):
    from transformers import AutoModelForCausalLM

    kind, root = converted
    model, _ = hf_model(kind)
    reloaded = AutoModelForCausalLM.from_pretrained(root / "back").eval()
    ids = torch.randint(0, 300, (2, 17))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_loaded_at_tp1_and_tp2_pp2_matches_transformers(converted, tmp_path):
    kind, root = converted
    torchrun("mcore_load_worker.py", 4, str(tmp_path), str(root / "mcore"), kind)
    merged = {}
    for f in tmp_path.glob("rank*.json"):
        merged.update(json.loads(f.read_text()))
    assert set(merged) == {"tp1-pp1", "tp2-pp2"}
    for layout, r in merged.items():
        assert r["tokens"] == 138 and r["max_abs_logp"] < 1e-4, (layout, r)


def test_bf16_round_trip_keeps_dtype_and_bits(tmp_path):
    model, _ = hf_model("llama")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    hf_to_mcore(tmp_path / "hf", tmp_path / "mcore", tp=1, pp=2)
    mcore_to_hf(tmp_path / "mcore", tmp_path / "back")
    src, back = HFCheckpoint(tmp_path / "hf"), HFCheckpoint(tmp_path / "back")
    assert sorted(back.names()) == sorted(src.names())
    for name in src.names():
        a, b = src.get(name), back.get(name)
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b), name


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_inputs")
    model, cfg = hf_model("qwen2")
    model.save_pretrained(root / "hf", max_shard_size="60KB")
    return root / "hf", cfg


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def _nothing_written(out: Path):
    return not out.exists() and not list(out.parent.glob(f".{out.name}.partial-*"))


def test_truncated_safetensors(source, tmp_path):
    bad = _copy(source[0], tmp_path / "bad")
    shard = sorted(bad.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-7])
    with pytest.raises(CheckpointError, match="truncated"):
        hf_to_mcore(bad, tmp_path / "out", tp=2, pp=2)
    assert _nothing_written(tmp_path / "out")


def test_unknown_tensor_name(source, tmp_path):
    from safetensors.torch import save_file

    bad = _copy(source[0], tmp_path / "bad")
    save_file({"model.layers.9.self_attn.q_proj.weight": torch.zeros(64, 64)}, str(bad / "x.safetensors"))
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.9.self_attn.q_proj.weight"] = "x.safetensors"
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(MappingError, match="model.layers.9.self_attn.q_proj.weight"):
        hf_to_mcore(bad, tmp_path / "out", tp=1, pp=1)
    assert _nothing_written(tmp_path / "out")


def test_shape_disagreeing_with_config(source, tmp_path):
    bad = _copy(source[0], tmp_path / "bad")
    (bad / "config.json").write_text(json.dumps({**source[1], "hidden_size": 32}))
    with pytest.raises(MappingError, match="config.json implies"):
        hf_to_mcore(bad, tmp_path / "out", tp=1, pp=1)
    assert _nothing_written(tmp_path / "out")


def test_unsupported_architecture(source, tmp_path):
    bad = _copy(source[0], tmp_path / "bad")
    (bad / "config.json").write_text(json.dumps({**source[1], "architectures": ["MistralForCausalLM"]}))
    with pytest.raises(ConfigError, match="architectures"):
        hf_to_mcore(bad, tmp_path / "out", tp=1, pp=1)
    assert _nothing_written(tmp_path / "out")


def test_output_that_already_holds_a_checkpoint(source, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metadata.json").write_text("{}")
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        hf_to_mcore(source[0], out, tp=1, pp=1)
    assert [p.name for p in out.iterdir()] == ["metadata.json"]
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        mcore_to_hf(tmp_path, source[0])


def test_sizes_that_do_not_divide(source, tmp_path):
    with pytest.raises(ConfigError, match="num_attention_heads"):
        hf_to_mcore(source[0], tmp_path / "out", tp=8, pp=1)
    assert _nothing_written(tmp_path / "out")
