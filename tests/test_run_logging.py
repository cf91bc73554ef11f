"""run_logging: every record and warning reaches the run's log file; the console gets ours, errors, and
everything only with --verbose."""

from __future__ import annotations

import io
import logging
import warnings

import pytest
import torch  # noqa: F401  (its import gives its loggers their own stderr handlers, which setup must route)

from megatron_dapo.observability.run_logging import log_file_path, setup_run_logging


@pytest.fixture
def restore_logging():
    """Undo setup_run_logging's changes to the process-wide logging state after each test."""
    from transformers.utils import logging as hf_logging

    root = logging.getLogger()
    saved_root = (list(root.handlers), root.level)
    torch_loggers = [(lg, list(lg.handlers), lg.propagate) for name, lg in logging.Logger.manager.loggerDict.items()
                     if isinstance(lg, logging.Logger) and (name == "torch" or name.startswith("torch."))]
    hf = logging.getLogger("transformers")
    saved_hf = (list(hf.handlers), hf.propagate, hf_logging.is_progress_bar_enabled())
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
        if handler not in saved_root[0]:
            handler.close()
    for handler in saved_root[0]:
        root.addHandler(handler)
    root.setLevel(saved_root[1])
    logging.captureWarnings(False)
    for lg, handlers, propagate in torch_loggers:
        lg.handlers[:] = handlers
        lg.propagate = propagate
    hf.handlers[:], hf.propagate = saved_hf[0], saved_hf[1]
    if saved_hf[2]:
        hf_logging.enable_progress_bar()


def _emit_all():
    logging.getLogger("megatron_dapo.trainer").info("ours: step 1 done")
    logging.getLogger("megatron_dapo.trainer").warning("ours: a warning")
    logging.getLogger("megatron.core.optimizer").info("theirs: Setting up optimizer with config OptimizerConfig(...)")
    logging.getLogger("megatron.core.rerun_state_machine").warning("theirs: Implicit initialization")
    logging.getLogger("torch.utils.cpp_extension").warning("theirs: No CUDA runtime is found")
    logging.getLogger("transformers.modeling_utils").warning("theirs: transformers says so")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("theirs: Apex is not installed", UserWarning)
    logging.getLogger("matplotlib.font_manager").error("theirs: an error")
    for handler in logging.getLogger().handlers:
        handler.flush()


THEIRS_BELOW_ERROR = ["Setting up optimizer", "Implicit initialization", "No CUDA runtime", "transformers says so",
                      "Apex is not installed"]


def test_foreign_records_and_warnings_reach_only_the_file(tmp_path, capsys, restore_logging):
    console = io.StringIO()
    path = setup_run_logging(tmp_path / "run", "demo", stream=console)
    assert path == tmp_path / "run" / "demo.log"
    _emit_all()
    text, shown = path.read_text(), console.getvalue()
    for message in ["ours: step 1 done", "ours: a warning", "theirs: an error", *THEIRS_BELOW_ERROR]:
        assert message in text
    assert "ours: step 1 done" in shown and "WARNING megatron_dapo.trainer: ours: a warning" in shown
    assert "ERROR matplotlib.font_manager: theirs: an error" in shown
    for message in THEIRS_BELOW_ERROR:
        assert message not in shown
    assert "UserWarning" in text  # the warning, with its category and place, as a py.warnings record
    err = capsys.readouterr().err  # torch's and transformers' own stderr handlers are out of the way
    assert "No CUDA runtime" not in err and "transformers says so" not in err
    assert len(shown.splitlines()) == 3


def test_verbose_puts_everything_on_the_console(tmp_path, restore_logging):
    console = io.StringIO()
    path = setup_run_logging(tmp_path, "train", verbose=True, stream=console)
    _emit_all()
    shown = console.getvalue()
    for message in ["ours: step 1 done", "ours: a warning", "theirs: an error", *THEIRS_BELOW_ERROR]:
        assert message in shown and message in path.read_text()


def test_other_ranks_print_only_warnings_and_write_their_own_file(tmp_path, restore_logging):
    console = io.StringIO()
    path = setup_run_logging(tmp_path, "train", rank=2, stream=console)
    assert path == log_file_path(tmp_path, "train", 2) == tmp_path / "train.rank2.log"
    _emit_all()
    shown = console.getvalue()
    assert "ours: step 1 done" not in shown and "ours: step 1 done" in path.read_text()
    assert "[rank 2] " in shown and "ours: a warning" in shown and "theirs: an error" in shown
    assert not any(message in shown for message in THEIRS_BELOW_ERROR)


def test_a_second_setup_replaces_the_first_and_append_keeps_earlier_lines(tmp_path, restore_logging):
    first, second = io.StringIO(), io.StringIO()
    setup_run_logging(tmp_path, "train", stream=first)
    logging.getLogger("megatron_dapo.x").info("first run")
    path = setup_run_logging(tmp_path, "train", stream=second)
    logging.getLogger("megatron_dapo.x").info("resumed run")
    assert "resumed run" not in first.getvalue() and second.getvalue().count("resumed run") == 1
    text = path.read_text()
    assert "first run" in text and text.count("resumed run") == 1
    setup_run_logging(tmp_path, "train", append=False, stream=io.StringIO())
    assert "first run" not in path.read_text()
