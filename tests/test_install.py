"""The package as a user gets it: a wheel built from this checkout, installed into a fresh
virtual environment (the already installed torch etc. visible to it), run from an empty
folder with no checkout in sight."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

from conftest import HANG_GUARD_S, REPO

SMOKE = [
    "model=cnn",
    "data=synthetic",
    "data.train_size=64",
    "data.test_size=32",
    "batch_size=32",
    "epochs=1",
]


def run(*command, cwd=None, env=None) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def see_this_interpreters_packages(environment) -> None:
    """Let the venv at `environment` import what this interpreter can (torch, hydra, ...).

    `system_site_packages=True` would not do: from inside a venv or a conda env it shows the
    base interpreter's site-packages, not the ones the dependencies were installed into. A .pth
    file in the new venv adds this interpreter's site folders, their own .pth files included,
    after the venv's own site-packages, so the wheel installed there still comes first."""
    folders = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
    python = environment / "bin" / "python"
    purelib = run(str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip()
    lines = [f"import site; site.addsitedir({folder!r})" for folder in folders]
    (Path(purelib) / "outer_site_packages.pth").write_text("\n".join(lines) + "\n")


def test_a_built_wheel_runs_from_any_folder_with_the_configs_inside(tmp_path):
    # Build from a copy: the checkout gets no build/ folder, and the wheel holds only what
    # an sdist would give it.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, source / name)
    for name in ("trainer", "conf"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        "dist",
        str(source),
        cwd=tmp_path,
    )
    [wheel] = (tmp_path / "dist").glob("trainer-*.whl")
    environment = tmp_path / "venv"
    venv.create(environment, with_pip=False)
    python, script = environment / "bin" / "python", environment / "bin" / "trainer"
    run(sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel))
    see_this_interpreters_packages(environment)  # after the install: pip sees and touches only the new venv

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {
        name: value for name, value in os.environ.items() if name not in ("PYTHONPATH", "HYDRA_FULL_ERROR")
    }
    where = run(str(python), "-c", "import trainer; print(trainer.__file__)", cwd=elsewhere, env=env)
    assert where.stdout.startswith(str(environment)), where.stdout  # the wheel's copy, not the checkout

    run(str(python), "-m", "trainer", *SMOKE, cwd=elsewhere, env=env)
    [metrics] = (elsewhere / "outputs").rglob("metrics.json")
    assert json.loads(metrics.read_text())["status"] == "completed"
    assert (metrics.parent / ".hydra" / "config.yaml").is_file()

    help_text = run(str(script), "--help", cwd=elsewhere, env=env).stdout
    assert "model  cnn, fastcnn, resnet18*" in help_text  # the groups, read from the configs inside the wheel
    assert "recipe default*, fastcnn_94, resnet18_94, resnet18_94_2gpu, resnet18_94_sgd" in help_text

    # The sweep report travels in the wheel too: as a module and as a command, on the run above.
    report_help = run(str(python), "-m", "trainer.report", "--help", cwd=elsewhere, env=env).stdout
    assert report_help.startswith("usage: python -m trainer.report")
    report = run(
        str(environment / "bin" / "trainer-report"), "outputs", "--out", "report", cwd=elsewhere, env=env
    )
    assert report.stdout.startswith("# Report: outputs") and "| completed |" in report.stdout
    assert {path.name for path in (elsewhere / "report").iterdir()} == {
        "report.md",
        "report.csv",
        "speedup.png",
        "accuracy_vs_time.png",
    }
    assert sorted(path.name for path in elsewhere.iterdir()) == ["outputs", "report"]

    # And the tuner: its module and its command answer from the wheel.
    tune_help = run(str(python), "-m", "trainer.tune", "--help", cwd=elsewhere, env=env).stdout
    assert tune_help.startswith("usage: python -m trainer.tune")
    tune_help = run(str(environment / "bin" / "trainer-tune"), "--help", cwd=elsewhere, env=env).stdout
    assert "--budget-min" in tune_help and "--trial-start" in tune_help
