"""Hugging Face checkpoints on disk: the validating reader and the atomic, streaming writer."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent / "distributed"))
from tiny_models import hf_model  # noqa: E402

from megatron_dapo.checkpoint.hf_mapping import MappingError  # noqa: E402
from megatron_dapo.checkpoint.safetensors_io import (  # noqa: E402
    CheckpointError,
    HFCheckpoint,
    write_hf_checkpoint,
)
from megatron_dapo.policy.hf_config import model_spec_from_hf  # noqa: E402


@pytest.fixture(scope="module", params=["qwen2", "qwen2_tied", "llama"])
def saved(request, tmp_path_factory):
    model, cfg = hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, max_shard_size="60KB")  # several shards and an index
    return model, cfg, path


def test_reader_sees_what_transformers_saved(saved):
    model, cfg, path = saved
    ckpt = HFCheckpoint(path)
    spec = model_spec_from_hf(ckpt.config)
    ckpt.validate(spec)
    state = model.state_dict()
    names = [n for n in ckpt.names()]
    assert len(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]) == len(names) > 10
    for name in names:
        assert torch.equal(ckpt.get(name), state[name])


def test_single_file_checkpoint(tmp_path):
    model, _ = hf_model("qwen2")
    model.save_pretrained(tmp_path)
    ckpt = HFCheckpoint(tmp_path)
    ckpt.validate(model_spec_from_hf(ckpt.config))
    assert torch.equal(ckpt.get("model.norm.weight"), model.state_dict()["model.norm.weight"])


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_truncated_file_is_refused(saved, tmp_path):
    _, _, path = saved
    bad = _copy(path, tmp_path / "bad")
    shard = sorted(bad.glob("*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: tensors need \d+ bytes but the file has \d+ \(truncated"):
        HFCheckpoint(bad)


def test_unknown_tensor_name_is_refused(saved, tmp_path):
    _, _, path = saved
    bad = _copy(path, tmp_path / "bad")
    save_file({"model.layers.0.mlp.mystery.weight": torch.zeros(3)}, str(bad / "extra.safetensors"))
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.mlp.mystery.weight"] = "extra.safetensors"
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    ckpt = HFCheckpoint(bad)
    with pytest.raises(MappingError, match="'model.layers.0.mlp.mystery.weight' is not part of"):
        ckpt.validate(model_spec_from_hf(ckpt.config))


def test_shape_that_disagrees_with_config_is_refused(saved, tmp_path):
    _, cfg, path = saved
    bad = _copy(path, tmp_path / "bad")
    (bad / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 128}))
    ckpt = HFCheckpoint(bad)
    with pytest.raises(MappingError, match=r"mlp.down_proj.weight has shape \(64, 96\) but config.json implies \(64, 128\)"):
        ckpt.validate(model_spec_from_hf(ckpt.config))


def test_index_pointing_at_a_missing_file(saved, tmp_path):
    _, _, path = saved
    bad = _copy(path, tmp_path / "bad")
    sorted(bad.glob("*.safetensors"))[0].unlink()
    with pytest.raises(CheckpointError, match="which is missing"):
        HFCheckpoint(bad)


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        HFCheckpoint(tmp_path)


def test_writer_round_trip_loads_in_transformers(saved, tmp_path):
    from transformers import AutoModelForCausalLM

    model, cfg, path = saved
    src = HFCheckpoint(path)
    out = write_hf_checkpoint(tmp_path / "out", ((n, src.get(n)) for n in src.names()), config=src.config,
                              max_shard_bytes=100_000)
    back = HFCheckpoint(out)
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    assert sorted(back.names()) == sorted(src.names())
    assert all(torch.equal(back.get(n), src.get(n)) for n in src.names())
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_writer_refuses_an_existing_checkpoint(saved):
    _, cfg, path = saved
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        write_hf_checkpoint(path, iter([]), config=cfg)


def test_crash_mid_write_leaves_nothing(tmp_path):
    def tensors():
        yield "model.norm.weight", torch.ones(4)
        yield "model.embed_tokens.weight", torch.ones(1000, 4)
        raise RuntimeError("gather failed")

    with pytest.raises(RuntimeError, match="gather failed"):
        write_hf_checkpoint(tmp_path / "out", tensors(), config={}, max_shard_bytes=1000)
    assert list(tmp_path.iterdir()) == []


def test_writer_copies_tokenizer_files(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer.json").write_text("{}")
    (src / "tokenizer_config.json").write_text("{}")
    out = write_hf_checkpoint(tmp_path / "out", iter([("model.norm.weight", torch.ones(2))]), config={"a": 1},
                              side_files_from=src)
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    assert json.loads((out / "config.json").read_text()) == {"a": 1}
