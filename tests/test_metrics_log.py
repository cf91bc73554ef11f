"""MetricsLogger (JSONL + tensorboard, resume without duplicates) and tools/plot_metrics.py."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dapo.observability import metrics_log
from megatron_dapo.observability.metrics_log import MetricsLogger, read_metrics

TOOLS = Path(__file__).resolve().parents[1] / "tools"
from megatron_dapo.observability.metrics_plot import panels, plot_metrics  # noqa: E402


def lines(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def scalars(run, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def log_steps(run, steps, resume_step=None, **kw):
    with MetricsLogger(run, resume_step=resume_step, **kw) as logger:
        for s in steps:
            logger.log(s, {"reward/mean": 0.1 * s, "accuracy": s / 10, "time/train": 2.0})


def test_one_json_line_per_step_and_tensorboard_scalars(tmp_path):
    log_steps(tmp_path, [1, 2, 3])
    got = lines(tmp_path)
    assert [r["step"] for r in got] == [1, 2, 3]
    assert got[1]["reward/mean"] == pytest.approx(0.2) and got[2]["accuracy"] == pytest.approx(0.3)
    assert set(got[0]) == {"step", "time", "reward/mean", "accuracy", "time/train"}
    assert got[0]["time"] <= got[2]["time"]
    assert [s for s, _ in scalars(tmp_path, "accuracy")] == [1, 2, 3]
    assert scalars(tmp_path, "reward/mean")[2][1] == pytest.approx(0.3)


def test_numbers_of_any_kind_are_stored_as_floats(tmp_path):
    import numpy as np
    import torch

    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(1, {"a": torch.tensor(1.5), "b": np.float32(2.5), "c": 3, "d": float("nan")})
    record = lines(tmp_path)[0]
    assert record["a"] == 1.5 and record["b"] == 2.5 and record["c"] == 3.0 and record["d"] != record["d"]
    assert not (tmp_path / "tensorboard").exists()


def test_resume_drops_the_steps_after_the_checkpoint(tmp_path):
    log_steps(tmp_path, [1, 2, 3, 4, 5])  # the run dies after step 5; its checkpoint is of step 3
    with MetricsLogger(tmp_path, resume_step=3) as logger:
        assert [r["step"] for r in lines(tmp_path)] == [1, 2, 3]
        logger.log(4, {"accuracy": 0.99})
        logger.log(5, {"accuracy": 0.98})
    got = lines(tmp_path)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    assert got[3] == {"step": 4, "time": got[3]["time"], "accuracy": 0.99}
    assert scalars(tmp_path, "accuracy") == [(1, pytest.approx(0.1)), (2, pytest.approx(0.2)),
                                             (3, pytest.approx(0.3)), (4, pytest.approx(0.99)),
                                             (5, pytest.approx(0.98))]


def test_a_new_run_starts_the_file_afresh(tmp_path):
    log_steps(tmp_path, [1, 2])
    log_steps(tmp_path, [1])
    assert [r["step"] for r in lines(tmp_path)] == [1]
    assert [s for s, _ in scalars(tmp_path, "accuracy")] == [1]


def test_a_torn_last_line_is_left_out(tmp_path):
    log_steps(tmp_path, [1, 2], tensorboard=False)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "accur')
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    log_steps(tmp_path, [3], resume_step=2, tensorboard=False)
    assert [r["step"] for r in lines(tmp_path)] == [1, 2, 3]


def test_a_corrupt_line_inside_the_file_is_an_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON line"):
        read_metrics(tmp_path / "metrics.jsonl")
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        MetricsLogger(tmp_path, resume_step=1)


@pytest.mark.parametrize("step,metrics,error,match", [
    (2, {"x": 1.0}, ValueError, "step: 2 is not after the last logged step 2"),
    (3, {"x": "high"}, TypeError, r"metrics\['x'\]: must be a number, got str"),
    (3, {"step": 1.0}, ValueError, r"metrics\['step'\]: names must be strings"),
    (3.0, {"x": 1.0}, TypeError, "step: must be an int"),
])
def test_bad_log_calls(tmp_path, step, metrics, error, match):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(2, {"x": 0.0})
        with pytest.raises(error, match=match):
            logger.log(step, metrics)
    assert [r["step"] for r in lines(tmp_path)] == [2]


def test_only_rank_zero_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics_log.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(metrics_log.dist, "get_rank", lambda: 1)
    with MetricsLogger(tmp_path / "run") as logger:
        logger.log(1, {"x": 1.0})
        with pytest.raises(ValueError, match="step"):  # the same checks on every rank
            logger.log(1, {"x": 1.0})
    assert not (tmp_path / "run").exists()


def test_panels_put_the_key_curves_first_group_the_rest_and_leave_out_what_never_changes():
    records = [{"step": 1, "time": 0.0, "loss": 0.5, "custom/b": 1.0, "grad_norm": 2.0, "groups_aborted": 0,
                "accuracy": 0.5, "time/rollout": 1.0, "groups_kept": 3, "mine": 7.0},
               {"step": 2, "time": 1.0, "loss": 0.4, "custom/a": 1.0, "grad_norm": 1.0, "groups_aborted": 0,
                "accuracy": 0.6, "time/rollout": 2.0, "groups_kept": 4, "eval/avg@4": 0.3, "mine": 7.0,
                "reward_mean": 0.2, "clip_frac/low": 0.1, "response_len_mean": 9.0}]
    groups, flat = panels(records)
    assert groups == {"accuracy and reward": ["accuracy", "reward_mean"], "held-out evaluation": ["eval/avg@4"],
                      "response length": ["response_len_mean"], "clip fractions": ["clip_frac/low"],
                      "grad norm": ["grad_norm"], "step time split (s)": ["time/rollout"],
                      "groups per step": ["groups_kept"], "loss": ["loss"], "custom": ["custom/b", "custom/a"]}
    # drawn once in two steps: a single point does not show that it never changes
    assert flat == {"groups_aborted": 0, "mine": 7.0}


def test_plot_writes_a_png_of_every_panel_and_lists_the_flat_series_under_it(tmp_path):
    import matplotlib.image

    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for s in range(1, 41):
            logger.log(s, {"reward_mean": s / 40, "accuracy": (s % 7) / 7, "filter_rate": 0.3 + s / 400,
                           "response_len_mean": 100 + s, "response_len_max": 200 + s, "entropy": 1 / s,
                           "clip_frac/low": 0.01 * s, "clip_frac/high": 0.02, "time/rollout": 3.0 + s,
                           "time/train": 1.0, "groups_aborted": 0, "prompts_too_long": 0,
                           **({"eval/avg@4": s / 40} if s % 10 == 0 else {})})
    out = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "plots" / "curves.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    height, width, _ = matplotlib.image.imread(out).shape
    # 7 panels: 4 columns x 2 rows, and a line under them (groups_aborted, prompts_too_long)
    assert width == 1600 and 2 * 280 < height <= 2 * 280 + 40, (width, height)


def test_plot_cli(tmp_path):
    log_steps(tmp_path, [1, 2, 3], tensorboard=False)
    cmd = [sys.executable, str(TOOLS / "plot_metrics.py"), str(tmp_path / "metrics.jsonl"), "-o",
           str(tmp_path / "out.png")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out.png").stat().st_size > 0


def test_plot_refuses_a_missing_or_empty_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such metrics file"):
        plot_metrics(tmp_path / "nope.jsonl", tmp_path / "out.png")
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="holds no metrics yet"):
        plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "out.png")
    proc = subprocess.run([sys.executable, str(TOOLS / "plot_metrics.py"), str(tmp_path / "metrics.jsonl")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "holds no metrics yet" in proc.stderr
    assert not (tmp_path / "out.png").exists() and not (tmp_path / "metrics.png").exists()


@pytest.fixture
def wandb_home(tmp_path, monkeypatch):
    """wandb's settings, cache and data folders in the test's own, out of the user's home."""
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_wandb_offline_gets_what_tensorboard_gets_and_the_config_and_a_resume_goes_on_in_the_same_run(
        tmp_path, wandb_home):
    from wandb_records import history, run_config, run_record

    from megatron_dapo.config import WandbConfig

    run = tmp_path / "run"
    settings = WandbConfig(project="dapo-test", name="trial", mode="offline")
    config = {"algorithm": {"group_size": 16}, "loss": {"eps_high": 0.28}}
    log_steps(run, [1, 2, 3], wandb=settings, run_config=config)
    log_steps(run, [3, 4], resume_step=2, wandb=settings, run_config=config)  # step 3 logged again after a resume

    first, resumed = sorted(run.glob("wandb/offline-run-*/run-*.wandb"), key=lambda p: p.stat().st_mtime)
    def rows(steps):  # what log_steps logged
        return [{"step": s, "reward/mean": 0.1 * s, "accuracy": s / 10, "time/train": 2.0} for s in steps]

    assert history(first) == rows([1, 2, 3]) and history(resumed) == rows([3, 4])
    ids = {run_record(p).run_id for p in (first, resumed)}
    assert ids == {(run / "wandb" / "run_id").read_text()}  # one wandb run, resumed
    assert run_record(first).project == "dapo-test" and run_record(first).display_name == "trial"
    assert run_config(first) == config
    assert [r["step"] for r in lines(run)] == [1, 2, 3, 4]  # the JSONL, as without wandb


def test_wandb_asked_for_but_not_installed_or_with_a_bad_mode_is_refused_by_name(monkeypatch):
    from megatron_dapo.config import ConfigError
    from megatron_dapo.run_config import config_from_dict

    base = {"model": {"path": "m"}, "data": {"train_path": "t.jsonl"}}
    with pytest.raises(ConfigError, match=r"metrics\.wandb\.mode: must be one of \('online', 'offline'\)"):
        config_from_dict(base, ["metrics.wandb.project=p", "metrics.wandb.mode=shared"])
    assert config_from_dict(base).metrics.wandb.project is None  # off by default
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"metrics\.wandb\.project: is 'p', but wandb is not installed: pip install "
                                          r"'megatron-dapo\[wandb\]', or set metrics\.wandb\.project to null"):
        config_from_dict(base, ["metrics.wandb.project=p"])
    config_from_dict(base)  # off, wandb is not needed
