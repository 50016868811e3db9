"""What `python -m trainer` answers before torch is loaded: a config mistake (in about a
second, not the seconds torch takes to import) and `--help`; and `python -m trainer.report`,
which never loads torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import HANG_GUARD_S, SMALL, cli_environment
from omegaconf import OmegaConf

from trainer import cli_help

# `python -m MODULE ARGS`, then report the exit code, what was printed and which heavy
# modules had been imported by then.
RUN_AND_REPORT = """
import contextlib, io, json, os, runpy, sys
module, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
def leave(code):  # a command ends with os._exit (trainer/process_exit.py): report first
    raise SystemExit(code)
os._exit = leave
out, err, code = io.StringIO(), io.StringIO(), 0
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exit:
        code = exit.code
heavy = ("torch", "torchvision", "tensorboard", "numpy", "matplotlib")
heavy = [name for name in heavy if name in sys.modules]
print(json.dumps({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue(), "imported": heavy}))
"""


def run_and_report(*args: str, cwd, module: str = "trainer") -> dict:
    result = subprocess.run(
        [sys.executable, "-c", RUN_AND_REPORT, module, *args],
        cwd=cwd,
        env=cli_environment(),
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["ampp=true"], "unknown config key 'ampp'"),
        (["model=resnet19"], "unknown model 'resnet19'"),
        (["resume=/does/not/exist"], "no checkpoint at /does/not/exist"),
        (["-m", "amp=false,maybe"], "invalid value for amp"),
    ],
    ids=["typo", "unknown-option", "missing-checkpoint", "sweep-value"],
)
def test_a_config_mistake_is_reported_before_torch_is_imported(tmp_path, args, fragment):
    report = run_and_report(*SMALL, *args, cwd=tmp_path)

    assert report["code"] == 2
    assert report["stderr"].startswith("trainer: error: ") and fragment in report["stderr"]
    assert report["imported"] == []
    assert not (tmp_path / "outputs").exists()


def test_help_lists_the_groups_and_points_to_every_key(tmp_path):
    report = run_and_report("model=cnn", "--help", cwd=tmp_path)

    help_text = report["stdout"]
    assert report["code"] == 0 and report["imported"] == []
    groups = help_text.split("Config groups")[1].split("\n\n")[0].splitlines()[1:]
    assert groups == [
        "  data   cifar10*, imagefolder, synthetic",
        "  model  cnn*, fastcnn, resnet18",
        "  optim  adamw, muon, sgd*",
        "  perf   baseline, default*, fast",
        "  recipe default*, fastcnn_94, resnet18_94, resnet18_94_2gpu, resnet18_94_sgd",
    ]
    assert "_schema" not in help_text
    assert "python -m trainer [group=option ...] --cfg job" in help_text
    assert "--config-dir ./my_conf perf=my_preset" in help_text
    assert "model.target=mypkg.nets:MyNet" in help_text
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ([], "the following arguments are required: folders (see python -m trainer.report --help)"),
        (["sweep", "--target-acc", "high"], "argument --target-acc: invalid float value: 'high'"),
        (["sweep", "--baseline"], "argument --baseline: expected one argument"),
    ],
    ids=["no-folder", "not-a-number", "missing-value"],
)
def test_a_report_argument_mistake_is_one_line_before_anything_heavy_is_imported(tmp_path, args, fragment):
    report = run_and_report(*args, cwd=tmp_path, module="trainer.report")

    assert report["code"] == 2 and report["stdout"] == ""
    assert report["stderr"].startswith("report: error: ") and report["stderr"].count("\n") == 1
    assert fragment in report["stderr"]
    assert report["imported"] == []


def test_report_help_and_a_whole_report_never_import_torch(tmp_path):
    help_text = run_and_report("--help", cwd=tmp_path, module="trainer.report")
    assert help_text["code"] == 0 and help_text["imported"] == []
    assert help_text["stdout"].startswith("usage: python -m trainer.report")
    for job, amp in enumerate(("false", "true")):  # two finished jobs of a sweep, as a run leaves them
        (tmp_path / "sweep" / str(job) / ".hydra").mkdir(parents=True)
        (tmp_path / "sweep" / str(job) / ".hydra" / "overrides.yaml").write_text(f"- amp={amp}\n")
        history = [{"epoch": 1, "img_per_s": 100.0 + job, "epoch_s": 1.0, "wall_s": 1.0, "test_acc": 0.5}]
        metrics = {"status": "completed", "img_per_s": 100.0 + job, "test_acc": 0.5, "history": history}
        (tmp_path / "sweep" / str(job) / "metrics.json").write_text(json.dumps(metrics))

    report = run_and_report(str(tmp_path / "sweep"), cwd=tmp_path, module="trainer.report")

    assert report["code"] == 0, report["stderr"]
    assert report["stdout"].startswith("# Report: ") and (tmp_path / "sweep" / "speedup.png").is_file()
    assert "torch" not in report["imported"] and "matplotlib" in report["imported"]


class HelpParts:
    """Stands in for Hydra where it makes the parts a help template can name."""

    def __init__(self) -> None:
        self.made: list[str] = []

    def format_args_help(self, _parser) -> str:
        self.made.append("flags")
        return "FLAGS"

    def format_config_groups(self, _predicate, compact: bool = True) -> str:
        self.made.append("groups")
        return "GROUPS"


def test_help_makes_only_the_parts_its_template_names():
    """Hydra lists the config groups for every help, used or not (0.5 s of --help's 0.9-1.1 s
    on a 2-core CPU); the trainer's template names none of Hydra's parts, and gets none made."""
    hydra, cfg = HelpParts(), OmegaConf.create({"lr": 0.1})
    plain = OmegaConf.create({"template": "groups listed by the trainer, $$5"})
    assert cli_help.get_help(hydra, plain, cfg, None, False) == "groups listed by the trainer, $5"
    assert hydra.made == []
    named = OmegaConf.create({"template": "$FLAGS_HELP | $APP_CONFIG_GROUPS"})  # as --hydra-help's
    assert cli_help.get_help(hydra, named, cfg, None, False) == "FLAGS | GROUPS"
    assert hydra.made == ["flags", "groups", "groups"]
