"""What `python -m trainer` answers before torch is loaded: a config mistake (in about a
second, not the seconds torch takes to import) and `--help`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import HANG_GUARD_S, SMALL, cli_environment

# `python -m trainer ARGS`, then report the exit code, what was printed and which heavy
# modules had been imported by then.
RUN_AND_REPORT = """
import contextlib, io, json, runpy, sys
sys.argv = ["trainer", *sys.argv[1:]]
out, err, code = io.StringIO(), io.StringIO(), 0
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
        runpy.run_module("trainer", run_name="__main__", alter_sys=True)
    except SystemExit as exit:
        code = exit.code
heavy = [name for name in ("torch", "torchvision", "tensorboard", "numpy") if name in sys.modules]
print(json.dumps({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue(), "imported": heavy}))
"""


def run_and_report(*args: str, cwd) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", RUN_AND_REPORT, *args],
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
        "  optim  adamw, sgd*",
        "  perf   baseline, default*, fast",
        "  recipe default*, fastcnn_94, resnet18_94",
    ]
    assert "_schema" not in help_text
    assert "python -m trainer [group=option ...] --cfg job" in help_text
    assert "--config-dir ./my_conf perf=my_preset" in help_text
    assert "model.target=mypkg.nets:MyNet" in help_text
    assert not (tmp_path / "outputs").exists()
