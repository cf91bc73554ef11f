"""The files a user hands in, malformed (issue 49): each is one line naming the file and what is wrong, never a
parser's traceback; through `megatron-dapo` itself for the run's YAML and the model's config.json and weight index."""

import json

import pytest
import torch

from megatron_dapo.checkpoint.safetensors_io import CheckpointError, HFCheckpoint
from megatron_dapo.cli import main
from megatron_dapo.config import ConfigError
from megatron_dapo.policy.hf_config import model_spec_from_hf
from megatron_dapo.user_files import UserFileError, json_field, read_json, read_yaml


@pytest.mark.parametrize("content,says", [
    (b'{"hidden_size": 64,}', "not valid JSON (line 1, column 20: Expecting property name enclosed in double quotes)"),
    (b"[1, 2]", "must hold a JSON object, holds list '[1, 2]'"),
    (b"\xff\xfe{}", "not UTF-8 text (byte 0): is it the file you meant?"),
    (b"", "not valid JSON (line 1, column 1: Expecting value)"),
])
def test_malformed_json_is_named(tmp_path, content, says):
    path = tmp_path / "config.json"
    path.write_bytes(content)
    with pytest.raises(UserFileError, match=f"^{path}: " + says.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("?", r"\?") + "$"):
        read_json(path)


def test_missing_and_unreadable_files_are_named(tmp_path):
    with pytest.raises(UserFileError, match=f"^{tmp_path / 'nope.json'}: no such file$"):
        read_json(tmp_path / "nope.json")
    with pytest.raises(UserFileError, match=f"^{tmp_path}: cannot be read: Is a directory$"):
        read_json(tmp_path)


def test_malformed_yaml_is_named_with_its_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  path: x\n data: [\n")
    with pytest.raises(ConfigError, match=rf"^{path}: not valid YAML \(line 3, column 2\): "):
        read_yaml(path, error=ConfigError)
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a YAML object, holds list"):
        read_yaml(path, error=ConfigError)
    path.write_text("")
    assert read_yaml(path) == {}


def test_a_field_of_the_wrong_type_is_named_with_its_key(tmp_path):
    with pytest.raises(UserFileError, match=r"^index.json: 'weight_map': must hold a JSON object, holds list"):
        json_field({"weight_map": ["a"]}, "weight_map", dict, "index.json")
    with pytest.raises(UserFileError, match=r"^index.json: no 'weight_map' key$"):
        json_field({}, "weight_map", dict, "index.json")


@pytest.mark.parametrize("change,says", [
    ({"hidden_size": "64"}, "hidden_size: must be a whole number >= 1 in config.json, got '64'"),
    ({"num_hidden_layers": 0}, "num_hidden_layers: must be a whole number >= 1 in config.json, got 0"),
    ({"num_key_value_heads": 1.5}, "num_key_value_heads: must be a whole number >= 1 in config.json, got 1.5"),
    ({"rms_norm_eps": -1e-6}, r"rms_norm_eps: must be a number in \(0, 1\) in config.json, got -1e-06"),
    ({"rope_theta": 0.0}, r"rope_theta: must be a finite number > 0 in config.json, got 0.0"),
])
def test_config_json_numbers_are_checked(change, says):
    config = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
              "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
    model_spec_from_hf(config)
    with pytest.raises(ConfigError, match=f"^{says}$"):
        model_spec_from_hf({**config, **change})


@pytest.fixture
def hf_folder(tmp_path):
    """A tiny Hugging Face folder with a weight index (its weights need not load)."""
    from safetensors.torch import save_file

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    save_file({"a": torch.zeros(2)}, str(folder / "model-00001-of-00001.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00001.safetensors"}}))
    return folder


def test_a_models_config_and_index_are_read_through_the_one_reader(hf_folder):
    HFCheckpoint(hf_folder)
    index = hf_folder / "model.safetensors.index.json"
    index.write_text('{"weight_map": ')
    with pytest.raises(CheckpointError, match=f"^{index}: not valid JSON"):
        HFCheckpoint(hf_folder)
    index.write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match=f"^{index}: no 'weight_map' key$"):
        HFCheckpoint(hf_folder)
    (hf_folder / "config.json").write_text("{")
    with pytest.raises(CheckpointError, match=f"^{hf_folder / 'config.json'}: not valid JSON"):
        HFCheckpoint(hf_folder)


def test_the_commands_say_a_malformed_file_in_one_line(tmp_path, capsys):
    """The run's YAML and the model's config.json, as `megatron-dapo train` and `preflight` meet them first."""
    run = tmp_path / "run.yaml"
    run.write_text("model:\n  path: [\n")
    assert main(["train", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"megatron-dapo train: bad config: {run}: not valid YAML (line 3"), err

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64,,}')
    run.write_text(f"model:\n  path: {model}\ndata:\n  train_path: train.jsonl\n")
    assert main(["preflight", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"megatron-dapo preflight: bad config: {model / 'config.json'}: not valid JSON (line 1, "
                          "column 59: Expecting property name"), err
