"""The documentation holds to the code: the configuration reference is what the dataclasses say, the README leads
to every guide, links resolve, and every command shown parses against the real command line (or says it needs a GPU
cluster)."""

import argparse
import re
import shlex
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
    assert "algorithm.preset" in keys()  # resolved by load_config before the sections are built
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


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
# a command in a fenced block that only a GPU cluster runs says so in the block
CLUSTER_MARK = re.compile(r"GPU cluster|GPU machine")
SHELL_TOOLS = ("tail", "cat")


def test_the_readme_is_a_front_door_to_every_guide():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 300
    linked = {m.group(1) for m in LINK.finditer(readme)}
    assert {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")} <= linked


@pytest.mark.parametrize("page", DOCS, ids=[p.name for p in DOCS])
def test_every_relative_link_resolves(page):
    for target in (m.group(1) for m in LINK.finditer(page.read_text())):
        if "://" in target or target.startswith("#"):
            continue
        assert (page.parent / target.split("#")[0]).exists(), f"{page.name}: {target}"


def commands(page: Path):
    """(the fenced bash block, one command of it with its continuation lines joined) of `page`."""
    for m in re.finditer(r"```bash\n(.*?)```", page.read_text(), re.S):
        block = m.group(1)
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                yield block, line


def checked(line: str, block: str) -> str:
    """What the command is checked as; fails where it is none of them."""
    from megatron_dapo.checkpoint.convert import add_arguments
    from megatron_dapo.cli import build_parser

    words = [w for w in shlex.split(line) if not re.match(r"^[A-Z_]+=", w)]  # environment assignments
    tool = words[0]
    if tool in ("sbatch", "torchrun", "srun") or tool == "bash" and words[1].startswith("tests/gpu"):
        assert CLUSTER_MARK.search(block), f"{line!r}: runs on GPUs only, and its block does not say so"
        if tool == "torchrun":
            build_parser().parse_args(words[words.index("megatron_dapo.cli") + 1:])
        return "cluster"
    if tool == "megatron-dapo":
        build_parser().parse_args(words[1:])
        return "cli"
    if tool in ("python", ".venv/bin/python") and words[1] == "tools/convert_checkpoint.py":
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        parser.parse_args(words[2:])
        return "cli"
    if tool in ("python", ".venv/bin/python"):
        assert (ROOT / words[1]).is_file(), line
        return "script"
    if tool == "make":
        assert re.search(rf"^{words[1]}:", (ROOT / "Makefile").read_text(), re.M), line
        return "make"
    assert tool in SHELL_TOOLS, f"{line!r}: not a command this project's docs may show"
    return "shell"


@pytest.mark.parametrize("page", DOCS, ids=[p.name for p in DOCS])
def test_every_documented_command_parses_or_says_it_needs_a_gpu_cluster(page):
    kinds = [checked(line, block) for block, line in commands(page)]
    if page.name == "README.md":
        assert kinds.count("cli") >= 4 and "cluster" in kinds


@pytest.mark.parametrize("page", DOCS, ids=[p.name for p in DOCS])
def test_every_config_snippet_names_real_keys(page):
    for block in re.findall(r"```yaml\n(.*?)```", page.read_text(), re.S):
        assert flat(yaml.safe_load(block)) <= keys(), f"{page.name}: {sorted(flat(yaml.safe_load(block)) - keys())}"
