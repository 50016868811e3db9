"""Shared test helpers: the real conf/, composed with Hydra and shrunk to run on a CPU in seconds."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from trainer.config import register_schema

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"
SUBSET = REPO.parent / "shared" / "datasets" / "cifar10-subset"

# A tiny but real run: the cnn on a few synthetic batches.
SMALL = [
    "model=cnn",
    "data=synthetic",
    "data.train_size=256",
    "data.test_size=128",
    "batch_size=32",
    "epochs=1",
    "log_every=2",
]

register_schema()


def compose_config(*overrides: str, small: bool = True):
    """The composed DictConfig for these overrides, as `python -m trainer` would see it."""
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("config", overrides=[*(SMALL if small else []), *overrides])


def cli_environment(env: dict | None = None) -> dict:
    """The environment for a `trainer` subprocess: this checkout first, Hydra's short errors."""
    environment = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    environment.pop("HYDRA_FULL_ERROR", None)
    return environment


def run_cli(
    *args: str,
    cwd: Path,
    timeout: float = 240,
    env: dict | None = None,
    file_size_limit: int | None = None,
    module: str = "trainer",
) -> subprocess.CompletedProcess:
    """`python -m trainer ARGS` (or another `module`) in a subprocess (output folders land under
    cwd/outputs); no file it writes may grow past file_size_limit bytes, when given (as with
    `ulimit -f`)."""

    def limit_file_size() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, hard))

    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=cli_environment(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=limit_file_size if file_size_limit else None,
    )


def read_metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def run_folders(root: Path) -> list[Path]:
    """Every folder under root that holds a .hydra/ folder (one per run or sweep job)."""
    return sorted(path.parent for path in root.rglob(".hydra"))


@pytest.fixture
def config():
    return compose_config


FINISHED = ("max_steps=2",)  # finished_run's overrides after SMALL


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory) -> Path:
    """The folder of a finished run: the cnn with SGD and OneCycle, 2 steps on 10 synthetic classes."""
    from trainer import Trainer

    run_dir = tmp_path_factory.mktemp("finished") / "run"
    Trainer(compose_config(*FINISHED), run_dir).fit()
    return run_dir


needs_subset = pytest.mark.skipif(
    not SUBSET.is_dir(), reason=f"the real-image subset is absent ({SUBSET}); it ships with shared/ in CI"
)
