"""Shared test helpers: the real conf/, composed with Hydra and shrunk to run on a CPU in seconds."""

from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from trainer import Trainer
from trainer.config import register_schema
from trainer.job_names import in_default_layout, job_place, sweep_jobs
from trainer.report.jobs import jobs_under

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


# One torch thread per process, in pytest and in every `trainer` it starts: the runs here are
# too small for a second thread to pay, and on a 2-core machine that something else also
# uses, torch's spinning threads made them 3-20x slower (measured: a SMALL run 1.3 s on one
# thread, 4-6 s on two, with another process busy beside it).
THREADS = "1"


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """Here, and in the processes started from here with this environment (the forkserver of
    trainer.trial_fork, which reads it when the first forked trial starts it)."""
    threads, variable = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(int(THREADS))
    os.environ["OMP_NUM_THREADS"] = THREADS
    yield
    torch.set_num_threads(threads)
    if variable is None:
        os.environ.pop("OMP_NUM_THREADS")
    else:
        os.environ["OMP_NUM_THREADS"] = variable


def restored_after_test(monkeypatch, variable: str) -> None:
    """`variable` as it is now, again after the test, whatever the code under test sets
    (monkeypatch.delenv alone records nothing for a variable that is not set)."""
    value = os.environ.get(variable)
    monkeypatch.setenv(variable, value if value is not None else "")
    if value is None:
        monkeypatch.delenv(variable)


def cli_environment(env: dict | None = None) -> dict:
    """The environment for a `trainer` subprocess: this checkout first on the path (then the
    caller's own PYTHONPATH, where a machine may keep Hydra), Hydra's short errors,
    one torch thread, and never handed to a server the machine may run (tests/test_serve.py
    starts its own)."""
    path = os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))
    environment = {
        **os.environ,
        "PYTHONPATH": path,
        "OMP_NUM_THREADS": THREADS,
        "TRAINER_SERVE": "0",
        **(env or {}),
    }
    environment.pop("HYDRA_FULL_ERROR", None)
    return environment


# Seconds after which a subprocess counts as hung. Only a guard against a hang: no test here
# needs a tenth of it on an idle machine, and none asserts on how long anything took.
HANG_GUARD_S = 600


def run_cli(
    *args: str,
    cwd: Path,
    timeout: float = HANG_GUARD_S,
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

    limit = limit_file_size if file_size_limit else None
    return run_interpreter(["-m", module, *args], cwd=cwd, env=env, timeout=timeout, preexec_fn=limit)


def run_python(
    code: str, *args: str, cwd: Path | None = None, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`python -c CODE ARGS`, as `run_cli` runs the trainer."""
    return run_interpreter(["-c", code, *args], cwd=cwd, env=env)


def run_interpreter(
    argv: list[str],
    cwd: Path | None,
    env: dict | None,
    timeout: float = HANG_GUARD_S,
    preexec_fn: Callable[[], None] | None = None,
) -> subprocess.CompletedProcess:
    """This interpreter with `argv` in a subprocess, in `cli_environment(env)`, its output
    captured as text."""
    return subprocess.run(
        [sys.executable, *argv],
        cwd=cwd,
        env=cli_environment(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=preexec_fn,
    )


def ended(pid: int) -> bool:
    """Gone, or a zombie that no longer runs (its reaper may be slow, e.g. in a container)."""
    try:
        return "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):  # reaped before, or between open and read
        return True


def ends_soon(pid: int) -> bool:
    """Whether the process has ended within 10 s (a killed process may linger a moment before
    it is reaped; only a guard: a process that was killed ends long before)."""
    for _ in range(100):
        if ended(pid):
            return True
        time.sleep(0.1)
    return False


def all_end(pids: list[int]) -> bool:
    """Whether every one of these processes ends within HANG_GUARD_S / 10 (60 s): for one that
    ends after its parent's parent tore down its interpreter, slow on a busy host. Only a guard:
    the test fails on a process that runs on, not on one that ends late."""
    for _ in range(int(HANG_GUARD_S)):
        if all(ended(pid) for pid in pids):
            return True
        time.sleep(0.1)
    return False


def read_metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def run_folders(root: Path) -> list[Path]:
    """Every run or sweep job (a folder holding .hydra/) under root, and the jobs of the sweep
    folders under it (the default layout puts them beside the single runs), in job order."""
    return jobs_under(root)


def sweep_job(sweep: Path, number: int) -> Path:
    """A sweep's job folder by its number (trainer/job_names.py), wherever it is."""
    [folder] = [job for job in sweep_jobs(sweep) if job_place(job).name.split("_")[0] == str(number)]
    return folder


def copy_sweep(sweep: Path, destination: Path, **copytree) -> Path:
    """A copy of a sweep and its jobs: of the folder that holds both (outputs/, for the default
    layout: outputs/multirun/<date>/<time> and outputs/<swept>/<date>_<time>_<n>) into
    destination; the copied sweep folder."""
    holder = sweep.parents[2] if in_default_layout(sweep) else sweep
    shutil.copytree(holder, destination, **copytree)
    return destination / sweep.relative_to(holder)


def assert_resumes_exactly(settings: tuple[str, ...], folder: Path) -> Trainer:
    """A run stopped (SIGTERM) after its first epoch and resumed ends with the weights of the
    same run left alone; returns the whole run's Trainer."""
    import signal

    class StopAfterFirstEpoch(Trainer):
        def evaluate(self) -> dict:
            signal.raise_signal(signal.SIGTERM)
            return super().evaluate()

    whole = Trainer(compose_config(*settings), folder / "whole")
    assert whole.fit()["status"] == "completed"
    assert StopAfterFirstEpoch(compose_config(*settings), folder / "stopped").fit()["status"] == "interrupted"
    resumed = Trainer(compose_config(*settings, f"resume={folder / 'stopped'}"), folder / "resumed")
    assert resumed.fit()["status"] == "completed"
    for (name, expected), actual in zip(
        whole.raw_model.state_dict().items(), resumed.raw_model.state_dict().values()
    ):
        assert torch.equal(expected, actual), name
    return whole


def job_number(name: str) -> str:
    """'3' of a report's job name '3_amp=true,channels_last=true'."""
    return name.split("_")[0]


@pytest.fixture
def config():
    return compose_config


# pytest-xdist (`-n auto --dist loadfile`, pyproject.toml) runs each file on one worker, so a
# file's module fixtures are made once. Files that share a session run go to the same worker
# too, so that it is made once: file -> the run.
SHARED_RUN_FILES = {
    "test_cli_run.py": "toggle_sweep",
    "test_report.py": "toggle_sweep",
    "test_data_sources.py": "real_image_run",
    "test_recipe.py": "real_image_run",
}
# The files that take longest (most launch processes), started first so that the shorter ones
# fill in around them at the end.
LONGEST_FIRST = (
    "test_ddp",
    "test_faults",
    "test_parallel_sweep",
    "test_recipe",
    "test_data_sources",
    "test_report",
    "test_cli_run",
    "test_torchrun",
    "test_toggles",
    "test_cli_errors",
    "test_tune",
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, with SHARED_RUN_FILES grouped (the xdist_group marks of --dist loadgroup
    have no effect with pytest 9.2: xdist renames an attribute pytest no longer reads)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LoadFileWithSharedRuns(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            return SHARED_RUN_FILES.get(Path(file).name, file)

    return LoadFileWithSharedRuns(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The LONGEST_FIRST files lead (`--no-loadscope-reorder` keeps this order under xdist)."""

    def rank(item: pytest.Item) -> int:
        module = item.module.__name__
        return LONGEST_FIRST.index(module) if module in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within each file stays


FINISHED = ("max_steps=2",)  # finished_run's overrides after SMALL


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory) -> Path:
    """The folder of a finished run: the cnn with SGD and OneCycle, 2 steps on 10 synthetic classes."""
    from trainer import Trainer

    run_dir = tmp_path_factory.mktemp("finished") / "run"
    Trainer(compose_config(*FINISHED), run_dir).fit()
    return run_dir


# SMALL for sweeps: 2 steps an epoch and 32 test images. Sweeps have amp=true jobs, and bf16
# autocast on a CPU without AVX-512 costs ~1 s a step (fp32: ~0.1 s).
SWEEP_SMALL = [
    *[override for override in SMALL if not override.startswith(("data.train_size=", "data.test_size="))],
    "data.train_size=64",
    "data.test_size=32",
]


def sweep(tmp_path_factory, name: str, *overrides: str) -> Path:
    """`python -m trainer -m OVERRIDES` in a fresh folder; returns the sweep folder
    (<cwd>/outputs/multirun/<date>/<time>)."""
    cwd = tmp_path_factory.mktemp(name)
    result = run_cli("-m", *overrides, cwd=cwd)
    sweeps = list((cwd / "outputs" / "multirun").glob("*/*"))
    assert len(sweeps) == 1, result.stderr[-3000:]
    return sweeps[0]


# The toggle sweep's jobs: two epochs, so that images/s leaves the first (warm-up) out and
# every row of the report has a speed-up; evaluated once, after the last.
TOGGLE_SWEEP = [*[override for override in SWEEP_SMALL if override != "epochs=1"], "epochs=2", "eval_every=2"]
TOGGLES = ["amp=false,true", "channels_last=false,true"]


@pytest.fixture(scope="session")
def toggle_sweep(tmp_path_factory) -> Path:
    """A 2 x 2 sweep of two toggles: test_cli_run checks its job folders, test_report reports on
    it (one launch for both)."""
    folder = sweep(tmp_path_factory, "toggles", *TOGGLE_SWEEP, *TOGGLES)
    assert [read_metrics(job)["status"] for job in run_folders(folder)] == ["completed"] * 4
    return folder


needs_subset = pytest.mark.skipif(
    not SUBSET.is_dir(), reason=f"the real-image subset is absent ({SUBSET}); it ships with shared/ in CI"
)


class LoggedLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="session")
def real_image_run(tmp_path_factory) -> dict:
    """The cnn, 2 epochs (78 steps) on the real-image subset, with a weight average updated
    every 5th step: test_data_sources checks that the cnn learns, test_recipe that the average
    tracks the trained weights. The average changes what is evaluated, not the training.
    {"trainer", "metrics", "trained_test_acc" (the trained weights', not the average's),
    "data_log" (what the data source logged)}."""
    from trainer import Trainer
    from trainer.config import TtaMode
    from trainer.evaluation import evaluate, tta_views

    cfg = compose_config(
        "model=cnn",
        "data=imagefolder",
        f"data.root={SUBSET}",
        "data.augment=false",  # two epochs are too few for augmentation to pay off
        "epochs=2",
        "batch_size=128",
        "optim=adamw",
        "optim.lr=0.002",
        "ema.enabled=true",
        "ema.decay=0.98",
        "ema.update_every=5",
        "eval.tta=none",  # each evaluation is of two models (average and trained weights): one view
        small=False,
    )
    data_log, logged = logging.getLogger("trainer.data.sources"), LoggedLines()
    level = data_log.level
    data_log.setLevel(logging.INFO)
    data_log.addHandler(logged)
    try:
        trainer = Trainer(cfg, tmp_path_factory.mktemp("real-images") / "run")
        metrics = trainer.fit()
    finally:
        data_log.removeHandler(logged)
        data_log.setLevel(level)
    trained = evaluate(trainer.raw_model, trainer.test_batches, tta_views(TtaMode.none), trainer.device)
    return {
        "trainer": trainer,
        "metrics": metrics,
        "trained_test_acc": trained["test_acc"],
        "data_log": "\n".join(logged.lines),
    }
