"""The one-call GPU check (tests/gpu/run.sh) where there is no GPU: its scripts parse and pass shellcheck, the
wheels it carries download and install for Python 3.12 within the size limit, it builds the extension in a
copy of the sources and stops cleanly without a CUDA device, its table survives failing steps, and the
end-to-end DAPO run it makes on the GPU completes on the CPU in device-faithful mode."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "tests" / "gpu"
SCRIPTS = [GPU / "run.sh", GPU / "fetch_wheels.sh"]
LIMIT_MIB = 60
# pip install --target for the GPU machine's Python, from here (the cp312 wheels are not importable here).
PY312 = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--platform",
         "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"]


def pins() -> list[tuple[str, str]]:
    lines = (line.split("#", 1)[0].strip() for line in (GPU / "wheels.txt").read_text().splitlines())
    return [tuple(line.split("==")) for line in lines if line]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def test_scripts_parse_and_pass_shellcheck():
    for script in SCRIPTS:
        subprocess.run(["bash", "-n", str(script)], check=True)
    if shutil.which("shellcheck") is None:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-q"], check=True, timeout=600, env=env)
        subprocess.run(["apt-get", "install", "-y", "-q", "shellcheck"], check=True, timeout=600, env=env)
    result = subprocess.run(["shellcheck", *map(str, SCRIPTS)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_wheel_list_pins_what_the_gpu_check_imports():
    names = {norm(n): v for n, v in pins()}
    assert len(names) == len(pins()), "one version of each package"
    assert {"megatron_core", "math_verify", "latex2sympy2_extended", "antlr4_python3_runtime", "psutil"} <= set(names)
    assert names["megatron_core"] == re.search(r'"megatron-core==([^"]+)"', (ROOT / "setup.py").read_text()).group(1)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpu-wheels") / "wheels"
    result = subprocess.run(["bash", str(GPU / "fetch_wheels.sh"), str(folder)], capture_output=True, text=True,
                            env={**os.environ, "PY": sys.executable}, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "MiB" in result.stdout
    return folder


def test_fetch_wheels_gives_one_small_cp312_wheel_per_pin(wheels):
    files = sorted(p.name for p in wheels.glob("*.whl"))
    assert len(files) == len(pins()), files
    for name, version in pins():
        assert any(f.startswith(f"{norm(name)}-{version}-") for f in files), (name, version, files)
    assert not [f for f in files if re.search(r"-cp3(?!12)\d+-cp3\d+-", f)], files  # no other CPython's build
    size = sum(p.stat().st_size for p in wheels.iterdir())
    assert size < LIMIT_MIB * 2**20, f"{size / 2**20:.1f} MiB"


def test_fetched_wheels_install_offline_for_python_312(wheels, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", str(site), *PY312, *map(str, sorted(wheels.glob("*.whl")))], check=True, timeout=300)
    installed = {norm(p.name.split("-")[0]) for p in site.glob("*.dist-info")}
    assert {norm(n) for n, _ in pins()} <= installed
    assert (site / "megatron" / "core").is_dir() and (site / "math_verify").is_dir()


def test_fetch_wheels_refuses_an_oversized_folder(tmp_path):
    folder = tmp_path / "wheels"
    folder.mkdir()
    (folder / "ballast.bin").write_bytes(b"\0" * (LIMIT_MIB * 2**20 + 1))
    result = subprocess.run(["bash", str(GPU / "fetch_wheels.sh"), str(folder)], capture_output=True, text=True,
                            env={**os.environ, "PY": sys.executable}, timeout=600)
    assert result.returncode != 0 and "over the 60 MiB" in result.stderr


@pytest.fixture(scope="module")
def source_copy(tmp_path_factory):
    """The files a GPU machine gets: tracked and untracked-but-not-ignored ones (no .venv, no built _C)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    dest = tmp_path_factory.mktemp("gpu-check") / "repo"
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    assert not list(dest.glob("megatron_dapo/_C*.so"))
    return dest


def run_check(copy: Path, out: Path, py: str, **env) -> subprocess.CompletedProcess:
    # A generous budget: on 2 busy cores the build alone may take minutes.
    env = {**os.environ, "PY": py, "OUT": str(out), "MEGATRON_DAPO_SKIP_CUDA": "1", "GPU_CHECK_BUDGET_S": "1400", **env}
    return subprocess.run(["bash", "tests/gpu/run.sh"], cwd=copy, capture_output=True, text=True, env=env,
                          timeout=1500)


@pytest.mark.slow
def test_run_sh_builds_in_place_and_stops_without_cuda(source_copy, tmp_path):
    result = run_check(source_copy, tmp_path / "out", sys.executable)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-6000:]
    assert "no CUDA device: megatron_dapo._C built in place" in result.stdout and "nothing else to check" in log
    assert list(source_copy.glob("megatron_dapo/_C*.so")), "no extension built in place"
    summary = (tmp_path / "out" / "gpu_check.md").read_text()
    assert re.search(r"\| build megatron_dapo._C \| PASS \| [0-9.]+ \| .*CUDA kernels: False", summary), summary


@pytest.mark.slow
def test_run_sh_runs_every_step_and_tabulates_failures(source_copy, tmp_path):
    """A CUDA device faked for run.sh's own check only: every step runs on this CPU machine (the wheels' packages
    are installed already, the CUDA tests skip, the benchmarks skip their CUDA sections, the end-to-end run finds
    no GPU and fails), and the table shows it."""
    fake = tmp_path / "python"
    fake.write_text("#!/usr/bin/env bash\n"
                    '[[ "$*" == *torch.cuda.is_available* ]] && exit 0\n'
                    f'exec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    result = run_check(source_copy, tmp_path / "out", str(fake), MEGATRON_DAPO_SITE=str(tmp_path / "site"))
    log = result.stdout + result.stderr
    assert result.returncode == 1, log[-6000:]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| ([^|-][^|]*?) \| ([^|]+?) \|", result.stdout, re.M)}
    assert rows.pop("step") == "status"
    assert list(rows) == ["build megatron_dapo._C", "install wheels", "fused op CUDA tests", "fused op benchmark",
                          "fused op host overhead", "policy bf16 vs transformers",
                          "MoE bf16 vs transformers (EP = 1)", "DAPO end to end (1 GPU)",
                          "train step (Qwen2.5-1.5B shape)", "packed vs padded step (Qwen2.5-1.5B shape)",
                          "weight export (Qwen2.5-1.5B shape)",
                          "train step fusions", "log-prob memory benchmark",
                          "attention memory at 22.5k tokens"], rows
    assert rows.pop("DAPO end to end (1 GPU)") == "FAIL (exit 2)"
    assert set(rows.values()) == {"PASS"}, rows
    summary = (tmp_path / "out" / "gpu_check.md").read_text()
    assert "skipped" in summary and "installed already: megatron-core" in summary
    assert len(list((tmp_path / "out").glob("*.log"))) == 14


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["dapo", "grpo"])
def test_e2e_dapo_on_cpu_in_device_faithful_mode(demo, tmp_path, preset):
    """The GPU check's end-to-end run at the GPU's precision (bf16 weights, fp32 master copy) on the CPU, with the
    demo's warm model: it learns, resumes and exports. With the master copy taken before the load (as on every
    GPU run before load_policy_weights) it collapses to accuracy 0 after the first update, and fails. GRPO, the
    baseline, learns too: its sample-level loss and KL term against the initial policy at that precision."""
    env = {**os.environ, "MEGATRON_DAPO_DEVICE_FAITHFUL": "1"}
    result = subprocess.run([sys.executable, str(GPU / "e2e_dapo.py"), "--device", "cpu", "--dtype", "bfloat16",
                             "--task", str(demo), "--out", str(tmp_path), "--preset", preset],
                            capture_output=True, text=True, env=env, timeout=900)
    log = result.stdout + result.stderr
    assert result.returncode == 0 and f"e2e_dapo ({preset}): PASS" in result.stdout, log[-8000:]
    res = json.loads((tmp_path / "e2e_dapo.json").read_text())
    assert res["dtype"] == "bfloat16" and len(res["steps"]) == 10 and not res["problems"]
    assert all(m["updates"] == 2 and m["groups_kept"] >= 1 for m in res["steps"])
    if preset == "grpo":  # every group drawn is trained on, and the KL term is on
        assert all(m["samples_per_kept_sample"] == 1 and "kl_reference" in m for m in res["steps"])
    assert res["eval_after"] >= res["eval_before"] + 0.1 and res["first_update_change"] < 0.05
    assert res["resumed"]["step"] == 10 and res["resumed"]["same_weights"] and res["resumed"]["updates"] == 2
    assert res["max_logprob_diff"] < 0.1 and res["parity_tokens"] > 0
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "tokenizer.json").is_file()