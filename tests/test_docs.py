"""The documentation holds to the code: the configuration reference is what the dataclasses say."""

from pathlib import Path

import pytest
import yaml

from megatron_dapo.cli import main
from megatron_dapo.config_reference import keys, reference
from megatron_dapo.run_config import config_from_dict, load_config

ROOT = Path(__file__).parents[1]
CONFIGS = sorted((ROOT / "launch" / "configs").glob("*.yaml"))


def test_the_configuration_page_is_the_generated_reference():
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == reference(), "docs/configuration.md is out of date: megatron-dapo config --reference > it"


def test_every_key_has_a_type_a_default_and_a_meaning():
    rows = [line for line in reference().splitlines() if line.startswith("| `")]
    assert len(rows) == len(keys()) > 90
    assert not [row for row in rows if row.rstrip().endswith("|  |")], "a key without a comment in the code"


def flat(data: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in data.items():
        key = f"{prefix}{k}"
        out |= flat(v, key + ".") if isinstance(v, dict) else {key}
    return out


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_key_of_a_shipped_config_is_in_the_reference(path):
    assert flat(yaml.safe_load(path.read_text())) <= keys()


def test_the_config_command_prints_the_resolved_config_and_the_reference(capsys):
    path = ROOT / "launch" / "configs" / "tiny-cpu.yaml"
    assert main(["config", str(path), "optim.lr=3e-4", "eval.every=0"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["optim"]["lr"] == 3e-4 and printed["eval"]["every"] == 0
    assert config_from_dict(printed) == load_config(path, ["optim.lr=3e-4", "eval.every=0"])
    assert main(["config", "--reference"]) == 0
    assert capsys.readouterr().out == reference()
    assert main(["config", str(path), "optim.lrr=3"]) == 2
    assert "optim.lrr: unknown key; did you mean optim.lr?" in capsys.readouterr().err
