"""Sweeps through Hydra's submitit launcher (the optional extra `.[slurm]`): a 2-job sweep runs
through submitit_local, and conf/hydra/launcher/slurm.yaml maps devices onto SLURM's GPUs."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from conftest import SMALL, cli_environment, read_metrics, run_cli, run_folders


def find_plugin():
    try:
        return importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher")
    except ModuleNotFoundError:  # not even the hydra_plugins namespace is there
        return None


PLUGIN = find_plugin()
pytestmark = pytest.mark.skipif(
    PLUGIN is None,
    reason='hydra-submitit-launcher is not installed (it is the optional extra: pip install -e ".[slurm]")',
)


def plugin_path() -> dict:
    """PYTHONPATH for the CLI: the tests' own (this checkout first) and wherever this pytest found
    the plugin."""
    site = Path(PLUGIN.submodule_search_locations[0]).parents[1]
    return {"PYTHONPATH": os.pathsep.join((cli_environment()["PYTHONPATH"], str(site)))}


def test_a_two_job_sweep_through_submitit_local(tmp_path):
    result = run_cli(
        "-m",
        "hydra/launcher=submitit_local",
        *SMALL,
        "max_steps=2",
        "seed=0,1",
        cwd=tmp_path,
        env=plugin_path(),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    jobs = [job for job in run_folders(tmp_path / "outputs") if (job / "metrics.json").is_file()]
    assert len(jobs) == 2
    assert sorted(read_metrics(job)["overrides"][-1] for job in jobs) == ["seed=0", "seed=1"]
    assert {read_metrics(job)["status"] for job in jobs} == {"completed"}


def test_the_slurm_launcher_asks_for_one_task_with_devices_gpus(tmp_path):
    command = ["hydra/launcher=slurm", "ddp=true", "devices=4", "--cfg", "all", "--resolve"]
    result = run_cli(*command, cwd=tmp_path, env=plugin_path())
    assert result.returncode == 0, result.stderr[-2000:]
    launcher = result.stdout.split("launcher:", 1)[1]
    assert "_target_: hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher" in launcher
    for line in ("gpus_per_node: 4", "tasks_per_node: 1", "nodes: 1"):
        assert line in launcher
    assert not (tmp_path / "outputs").exists()
