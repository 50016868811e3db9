"""Hydra's question of a command's mode answered from the command line's checks
(trainer/run_mode.py): a single run composes its config twice, the checks' and the run's, not
three times; a command whose overrides the checks did not compose as Hydra sees them is left
to Hydra."""

from __future__ import annotations

import logging
import sys

import pytest
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.types import RunMode

import trainer.__main__ as cli
from trainer import run_mode
from trainer.cli_checks import CONF_DIR, composed


@pytest.fixture
def compositions(monkeypatch):
    """Every composition of the config in this process, counted."""
    counted = []
    original = ConfigLoaderImpl.load_configuration

    def load_configuration(self, *args, **kwargs):
        counted.append(kwargs.get("run_mode"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration", load_configuration)
    monkeypatch.setattr(run_mode, "_checked", None)
    return counted


@pytest.fixture(autouse=True)
def logging_kept():
    """Hydra's main configures logging for its job (hydra/job_logging=disabled switches every
    logger off): each logger as it was, for the tests that read the log after these."""
    loggers = [logging.getLogger(), *(item for item in logging.Logger.manager.loggerDict.values())]
    kept = [
        (logger, logger.disabled, logger.level, list(logger.handlers), logger.propagate)
        for logger in loggers
        if isinstance(logger, logging.Logger)
    ]
    yield
    for logger, disabled, level, handlers, propagate in kept:
        logger.disabled, logger.level, logger.handlers, logger.propagate = (
            disabled,
            level,
            handlers,
            propagate,
        )


def job_started(monkeypatch, args: list[str]) -> list[str]:
    """The run folder of the job Hydra starts for `python -m trainer ARGS` (the job stubbed)."""
    started = []
    monkeypatch.setattr(cli, "run", lambda cfg, run_dir, *rest: started.append(run_dir) or 0.0)
    quiet = ["hydra/job_logging=disabled", "hydra/hydra_logging=disabled", "hydra.output_subdir=null"]
    monkeypatch.setattr(sys, "argv", ["trainer", *args, *quiet])
    cli.main()
    return started


def test_a_single_run_composes_its_config_twice(compositions, monkeypatch, tmp_path):
    """...and CUDA's driver is asked to start with the checks' composition, before Hydra's."""
    driver_asked = []
    monkeypatch.setattr(cli.cuda_driver, "start_for_run", lambda cfg: driver_asked.append(len(compositions)))
    folder = tmp_path / "run"
    args = ["model=cnn", "data=synthetic", "device=cpu", f"hydra.run.dir={folder}"]
    assert job_started(monkeypatch, args) == [str(folder)]
    assert len(compositions) == 2  # the checks', the run's: Hydra's question of the mode answered
    assert driver_asked == [1]


def test_overrides_the_checks_saw_otherwise_are_left_to_hydra(compositions, monkeypatch, tmp_path):
    """--config-dir adds a search path to the checks' overrides: Hydra asks for itself."""
    folder = tmp_path / "run"
    (tmp_path / "conf").mkdir()
    args = ["--config-dir", str(tmp_path / "conf"), "model=cnn", "data=synthetic", "device=cpu"]
    args += [f"hydra.run.dir={folder}"]
    assert job_started(monkeypatch, args) == [str(folder)]
    assert len(compositions) == 3


def test_the_mode_is_the_checks_for_the_same_overrides_in_the_same_order_only(monkeypatch):
    """A later override of a key wins: the same words in another order are another command."""
    monkeypatch.setattr(run_mode, "_checked", None)
    cfg = composed(["model=cnn", "hydra.mode=MULTIRUN"], hydra_config=True)
    run_mode.remember(["model=cnn", "hydra.mode=MULTIRUN"], cfg)
    assert run_mode.checked_mode("config", ["model=cnn", "hydra.mode=MULTIRUN"]) == (True, RunMode.MULTIRUN)
    assert run_mode.checked_mode("config", ["hydra.mode=MULTIRUN", "model=cnn"])[0] is False
    assert run_mode.checked_mode("other", ["model=cnn", "hydra.mode=MULTIRUN"])[0] is False
    assert run_mode.checked_mode("config", ["model=cnn"])[0] is False
    run_mode.forget()
    assert run_mode.checked_mode("config", ["model=cnn", "hydra.mode=MULTIRUN"])[0] is False


def test_a_hydra_override_the_checks_move_leaves_the_mode_to_hydra(compositions, monkeypatch, tmp_path):
    """++hydra.mode is among the checks' plain overrides, hydra.mode among Hydra's: the checks'
    list is in another order, and the command's last word is Hydra's to weigh (a single run)."""
    folder = tmp_path / "run"
    args = ["model=cnn", "data=synthetic", "device=cpu", f"hydra.run.dir={folder}"]
    args += [f"hydra.sweep.dir={tmp_path / 'sweep'}", "hydra.mode=MULTIRUN", "++hydra.mode=RUN"]
    assert job_started(monkeypatch, args) == [str(folder)]
    assert len(compositions) == 3


def test_a_config_path_flag_leaves_the_mode_and_the_driver_to_the_job(compositions, monkeypatch, tmp_path):
    """-cp: Hydra reads another config.yaml than the checks composed."""
    driver_asked = []
    monkeypatch.setattr(cli.cuda_driver, "start_for_run", driver_asked.append)
    folder = tmp_path / "run"
    args = ["-cp", str(CONF_DIR), "model=cnn", "data=synthetic", "device=cpu", f"hydra.run.dir={folder}"]
    assert job_started(monkeypatch, args) == [str(folder)]
    assert len(compositions) == 3 and driver_asked == []


def test_a_command_that_only_prints_starts_no_driver(monkeypatch, capsys):
    """--cfg job prints the config: nothing runs on CUDA."""
    driver_asked = []
    monkeypatch.setattr(cli.cuda_driver, "start_for_run", driver_asked.append)
    monkeypatch.setattr(run_mode, "_checked", None)
    monkeypatch.setattr(sys, "argv", ["trainer", "--cfg", "job", "model=cnn", "data=synthetic"])
    cli.main()
    assert "model:" in capsys.readouterr().out
    assert driver_asked == []
