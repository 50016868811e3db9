"""A user's own presets (`--config-dir`) and own model (`model.target=module:callable`),
without editing the package."""

from __future__ import annotations

import textwrap

import pytest
import torch
from conftest import SMALL, compose_config, read_metrics, run_cli, run_folders

from trainer import Trainer
from trainer.cli_checks import check_command_line
from trainer.config import ConfigError

MY_NETS = """
from torch import nn


class TinyNet(nn.Sequential):
    def __init__(self, num_classes):
        super().__init__(nn.Flatten(), nn.Linear(3 * 32 * 32, num_classes))


def not_a_model(num_classes):
    return {"classes": num_classes}
"""


@pytest.fixture
def my_nets(tmp_path, monkeypatch):
    """A module of the user's, importable as `my_nets` (as from the folder holding it)."""
    (tmp_path / "my_nets.py").write_text(MY_NETS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.fixture
def my_conf(tmp_path):
    preset = tmp_path / "my_conf" / "perf" / "my_preset.yaml"
    preset.parent.mkdir(parents=True)
    preset.write_text("# @package _global_\nbatch_size: 64\nset_to_none: true\n")
    return preset.parent.parent


def test_a_preset_from_the_users_config_dir_runs(tmp_path, my_conf):
    overrides = [override for override in SMALL if not override.startswith("batch_size=")]

    result = run_cli("--config-dir", str(my_conf), "perf=my_preset", *overrides, cwd=tmp_path)

    assert result.returncode == 0, result.stdout + result.stderr
    [run] = run_folders(tmp_path / "outputs")
    metrics = read_metrics(run)
    assert metrics["status"] == "completed"
    assert metrics["steps"] == 256 // 64  # the preset's batch size
    assert "set_to_none: true" in (run / ".hydra" / "config.yaml").read_text()


def test_the_check_searches_the_users_config_dir_and_lists_its_presets(my_conf):
    check_command_line([f"--config-dir={my_conf}", "perf=my_preset", "model=cnn", "data=synthetic"])
    check_command_line(["-cd", str(my_conf), "-m", "perf=baseline,my_preset", "data=synthetic"])
    with pytest.raises(ConfigError) as caught:
        check_command_line(["--config-dir", str(my_conf), "perf=my_presett"])

    assert str(caught.value) == (
        "unknown perf 'my_presett': choose perf=baseline or perf=default or perf=fast or perf=my_preset"
    )


def test_a_model_from_a_users_module_trains(my_nets, tmp_path):
    metrics = Trainer(compose_config("model.target=my_nets:TinyNet"), tmp_path / "run").fit()

    assert metrics["status"] == "completed"
    weights = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=False)["model"]
    assert {name: tuple(tensor.shape) for name, tensor in weights.items()} == {
        "1.weight": (10, 3 * 32 * 32),
        "1.bias": (10,),
    }
    # forward and the weight gradient (the images need no gradient): two matmuls of 2 x 3072 x 10
    assert metrics["flops_per_image"] == 2 * (2 * 3 * 32 * 32 * 10)


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("my_nets", "model.target=my_nets is not module:callable: set model.target=mypkg.nets:MyNet"),
        (
            "no_such_module:Net",
            "model.target=no_such_module:Net: cannot import no_such_module (ModuleNotFoundError: "
            "No module named 'no_such_module'): install it, or add its folder to PYTHONPATH",
        ),
        (
            "my_nets:Missing",
            "model.target=my_nets:Missing: my_nets has no callable 'Missing': "
            "set model.target=my_nets:<a class or function in it>",
        ),
        (
            "my_nets:not_a_model",
            "model.target=my_nets:not_a_model returned a dict, not a torch.nn.Module: "
            "make not_a_model(num_classes) return one",
        ),
    ],
)
def test_a_model_target_that_cannot_be_used_is_one_line(my_nets, target, message):
    with pytest.raises(ConfigError) as caught:
        check_command_line([*SMALL, f"model.target={target}"])

    assert str(caught.value) == message


def test_a_bad_model_target_stops_before_the_run_folder(tmp_path):
    (tmp_path / "my_nets.py").write_text(textwrap.dedent(MY_NETS))

    result = run_cli(*SMALL, "model.target=my_nets:not_a_model", cwd=tmp_path)

    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip() == (
        "trainer: error: model.target=my_nets:not_a_model returned a dict, not a torch.nn.Module: "
        "make not_a_model(num_classes) return one"
    )
    assert not (tmp_path / "outputs").exists()
