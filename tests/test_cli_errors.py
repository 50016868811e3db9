"""Bad input on the command line: one line naming the fix, a non-zero exit, no traceback, no checkpoint.

Mistakes in the command line itself are caught before Hydra makes a run folder and printed
as `trainer: error: ...` on stderr (exit 2). Problems found while the run starts (a missing
dataset) or trains (a non-finite loss) are one ERROR log line (exit 1) and a metrics.json
that says `failed`.
"""

from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import REPO, SMALL, compose_config, read_metrics, run_cli, run_folders

from trainer import Trainer
from trainer.command_line import override_slip
from trainer.config import ConfigError, to_train_config
from trainer.data import DatasetNotFoundError
from trainer.trainer import NonFiniteLoss

# case id -> (overrides after SMALL, fragments the one error line must hold)
CONFIG_ERRORS = {
    "typo": (["ampp=true"], ["unknown config key 'ampp'", "Did you mean 'amp'?"]),
    "typo-added-with-plus": (["+ampp=true"], ["unknown config key 'ampp'", "Did you mean 'amp'?"]),
    "not-an-integer": (["epochs=two"], ["invalid value for epochs", "'two'", "Integer"]),
    "not-a-bool": (["amp=maybe"], ["invalid value for amp", "'maybe'", "bool"]),
    "unknown-model": (["model=resnet19"], ["unknown model 'resnet19'", "model=cnn", "model=resnet18"]),
    "zero-batch": (["batch_size=0"], ["batch_size must be at least 1, got 0", "set batch_size=1 or more"]),
    "missing-checkpoint": (
        ["resume=/does/not/exist"],
        ["resume=/does/not/exist", "no checkpoint at /does/not/exist", "checkpoints/last.pt"],
    ),
    # another tool's option syntax, or spaces around '=': the override meant, in one line
    "dashed-option": (["--epochs", "1"], ["`--epochs 1` is not an override: write epochs=1"]),
    "dashed-with-equals": (["--epochs=1"], ["`--epochs=1` is not an override: write epochs=1"]),
    "spaces-around-equals": (["epochs", "=", "1"], ["`epochs = 1` is not an override: write epochs=1"]),
    "group-with-spaces": (["model", "=", "cnn"], ["`model = cnn` is not an override: write model=cnn"]),
    "cuda-hidden": (
        ["device=cuda"],  # with every GPU hidden (CASE_ENV), whatever the machine has
        ["device=cuda but no CUDA device is visible: use device=cpu or device=auto"],
    ),
    # Hydra's own keys and groups: a traceback before they were composed with the rest
    "unknown-hydra-key": (["hydra.foo=1"], ["unknown config key 'hydra.foo'", "--cfg hydra"]),
    "unknown-launcher": (
        ["hydra/launcher=nope"],
        ["unknown hydra/launcher 'nope'", "hydra/launcher=basic", "hydra/launcher=parallel"],
    ),
    "run-folder-under-a-file": (
        [f"hydra.run.dir={REPO}/README.md/run"],
        [f"cannot make the run folder {REPO}/README.md/run: {REPO}/README.md is a file", "hydra.run.dir=/a"],
    ),
}
# case id -> overrides after SMALL; {empty} is an empty folder
RUNTIME_ERRORS = {
    "cifar10-absent": ["data=cifar10", "data.root={empty}", "data.download=false"],
    "imagefolder-absent": ["data=imagefolder", "data.root={empty}"],
    "non-finite-loss": ["optim.lr=1e30"],  # the first step throws the cnn's weights to ~1e30
    "checkpoint-not-written": [],  # under a file-size limit smaller than the checkpoint
}
FILE_SIZE_LIMITS = {"checkpoint-not-written": 1_000_000}  # bytes; the cnn's checkpoint is ~9 MB
CASE_ENV = {"cuda-hidden": {"CUDA_VISIBLE_DEVICES": ""}}


@pytest.fixture(scope="module")
def empty_folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("empty-data-root").resolve()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, empty_folder) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Every bad command line, each in its own folder, two at a time: each process spends
    seconds importing torch, so one after the other would double this file's time."""
    commands = {case: overrides for case, (overrides, _) in CONFIG_ERRORS.items()}
    commands |= {
        case: [override.format(empty=empty_folder) for override in overrides]
        for case, overrides in RUNTIME_ERRORS.items()
    }

    def run(case: str) -> tuple[subprocess.CompletedProcess, Path]:
        cwd = tmp_path_factory.mktemp(case)
        limit = FILE_SIZE_LIMITS.get(case)
        return run_cli(*SMALL, *commands[case], cwd=cwd, file_size_limit=limit, env=CASE_ENV.get(case)), cwd

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(commands, pool.map(run, commands)))


def non_empty_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def checkpoints_under(folder: Path) -> list[Path]:
    return [*folder.rglob("checkpoints"), *folder.rglob("*.pt")]


def the_error_log_line(result: subprocess.CompletedProcess) -> str:
    """The single ERROR line of the console log: on stderr, like every warning and error."""
    lines = [line for line in result.stderr.splitlines() if "[ERROR]" in line]
    assert len(lines) == 1, result.stdout + result.stderr
    assert "[ERROR]" not in result.stdout
    return lines[0]


@pytest.mark.parametrize("case", CONFIG_ERRORS)
def test_command_line_mistake_is_one_line_and_leaves_no_run_folder(outcomes, case):
    result, cwd = outcomes[case]
    _, fragments = CONFIG_ERRORS[case]

    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    lines = non_empty_lines(result.stderr)
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("trainer: error: ")
    for fragment in fragments:
        assert fragment in lines[0]
    assert result.stdout.strip() == ""
    assert not (cwd / "outputs").exists()


@pytest.mark.parametrize(
    ("case", "looked_at", "source_hint"),
    [
        (
            "cifar10-absent",
            "CIFAR-10 not found in {empty} (no cifar-10-batches-py there and data.download=false",
            "data.download=false",
        ),
        ("imagefolder-absent", "no class folders in {empty}/train", "train/<class>/ and test/<class>/"),
    ],
)
def test_missing_dataset_names_the_folder_and_the_fixes_before_a_run_folder(
    outcomes, empty_folder, case, looked_at, source_hint
):
    result, cwd = outcomes[case]

    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    [line] = non_empty_lines(result.stderr)
    assert line.startswith("trainer: error: ")
    assert looked_at.format(empty=empty_folder) in line
    assert "Fix: data.root=" in line
    assert source_hint in line
    assert line.endswith("or data=synthetic")
    assert not (cwd / "outputs").exists()


@pytest.mark.parametrize(
    ("overrides", "looked_at"),
    [
        (
            ["data=cifar10", "data.download=false"],
            "CIFAR-10 not found in {empty} (no intact cifar-10-batches-py",
        ),
        (["data=imagefolder"], "no class folders in {empty}/train"),
    ],
)
def test_the_run_itself_still_names_a_missing_dataset(tmp_path, empty_folder, overrides, looked_at):
    """Through the API, where no command line was checked first: the same message, from the source."""
    with pytest.raises(DatasetNotFoundError, match=re.escape(looked_at.format(empty=empty_folder))):
        Trainer(compose_config(*overrides, f"data.root={empty_folder}"), tmp_path / "run").fit()


def test_non_finite_loss_names_the_step_and_a_lower_learning_rate(outcomes):
    result, cwd = outcomes["non-finite-loss"]

    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    line = the_error_log_line(result)
    assert "training loss became " in line
    # Step 1's loss is computed before its update, so step 2 is the first non-finite one.
    assert "at optimizer step 2 (epoch 1)" in line
    # amp is off: nothing to say about it; batch 32 is a quarter of the lr's base batch 128
    assert line.endswith("lower optim.lr (now 1e+30, a peak of 2.5e+29 at this batch)")
    [run] = run_folders(cwd / "outputs")
    metrics = read_metrics(run)
    assert metrics["status"] == "diverged"
    assert metrics["steps"] == 2
    assert metrics["error"] in line
    assert checkpoints_under(cwd / "outputs") == []


def test_non_finite_loss_under_amp_also_suggests_turning_amp_off(tmp_path):
    with pytest.raises(NonFiniteLoss) as caught:  # amp on the CPU is bf16
        Trainer(compose_config("optim.lr=1e30", "amp=true"), tmp_path / "run").fit()

    assert str(caught.value).endswith(
        "lower optim.lr (now 1e+30, a peak of 2.5e+29 at this batch), or set amp=false"
    )


def test_a_checkpoint_that_cannot_be_written_says_why_and_leaves_no_partial_file(outcomes):
    result, cwd = outcomes["checkpoint-not-written"]

    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    [run] = run_folders(cwd / "outputs")
    line = the_error_log_line(result)
    assert f"could not write the checkpoint {run / 'checkpoints' / 'last.pt'} (File too large)" in line
    assert "set hydra.run.dir=" in line
    assert read_metrics(run)["status"] == "failed"
    assert [*run.rglob("*.pt"), *run.rglob("*.tmp")] == []


# overrides -> what to_train_config says about them
SCHEMA_ERRORS = [
    (["grad_accum_steps=0"], "grad_accum_steps must be at least 1, got 0: set grad_accum_steps=1 or more"),
    (["eval_every=0"], "eval_every must be at least 1, got 0: set eval_every=1 or more"),
    (["max_steps=0"], "max_steps must be null or at least 1, got 0"),
    (["num_workers=-1"], "num_workers must be auto or a whole number >= 0, got -1: set num_workers=auto"),
    (["num_workers=many"], "num_workers must be auto or a whole number >= 0, got 'many'"),
    (["data.loader=gpu", "data.decode=every_epoch"], "data.loader=gpu holds the decoded images on the"),
    (["device=gpu"], "device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
    (["perf=fast", "set_to_none=false"], "compile_mode=reduce_overhead replays CUDA graphs, whose gradient"),
    (["num_workers=0", "persistent_workers=true"], "need worker processes: set num_workers=2"),
    (["data=cifar10", "data.root=null"], "data=cifar10 needs a folder: set data.root=/path/to/data"),
    (["data.train_size=0"], "data.train_size and data.test_size must be at least 1"),
    (["optim.warmup_frac=0"], "optim.warmup_frac must be in (0, 1), got 0.0"),
    (["optim.label_smoothing=1.0"], "optim.label_smoothing must be in [0, 1), got 1.0"),
    # Hydra lets `+key=value` through; the schema re-merge rejects it.
    (["+ampp=true"], "unknown config key 'ampp'. Did you mean 'amp'?"),
]


@pytest.mark.parametrize(
    ("overrides", "message"), SCHEMA_ERRORS, ids=[" ".join(overrides) for overrides, _ in SCHEMA_ERRORS]
)
def test_schema_rejects_bad_values_in_process(overrides, message):
    with pytest.raises(ConfigError) as caught:
        to_train_config(compose_config(*overrides))

    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_sweep_is_checked_value_by_value_with_its_fixed_overrides(tmp_path):
    from trainer.cli_checks import check_command_line

    for split in ("train", "test"):
        (tmp_path / split / "a").mkdir(parents=True)
    check_command_line(["-m", "data=imagefolder", f"data.root={tmp_path}", "amp=false,true"])
    with pytest.raises(ConfigError, match="invalid value for amp"):
        check_command_line(["-m", "model=cnn", "data=synthetic", "amp=false,maybe"])
    with pytest.raises(ConfigError, match="data.loader=gpu uses no worker processes"):
        check_command_line(["-m", "num_workers=2", "data=synthetic", "data.loader=torch,gpu"])


def test_a_small_sweep_is_checked_job_by_job_and_hydra_does_not_compose_its_jobs_again(monkeypatch):
    """Every combination is a job: one that fails only in combination is refused before any
    folder. Hydra's own pass over the batch is then left out; where the checks did not see
    every job (more than 64), Hydra makes it as before."""
    from hydra.core.plugins import Plugins

    from trainer import sweep_checks
    from trainer.cli_checks import check_command_line

    with pytest.raises(ConfigError, match="data.loader=gpu uses no worker processes"):
        check_command_line(["-m", "data=synthetic", "data.loader=torch,gpu", "num_workers=0,2"])
    Plugins.instance()  # its scan replaces the sweeper's module: the class Hydra runs is the one after it
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    asked = []
    monkeypatch.setattr(BasicSweeper, "validate_batch_is_legal", lambda self, batch: asked.append(batch))
    monkeypatch.setattr(sweep_checks, "jobs_checked", False)
    sweep_checks.install()
    base = ["-m", "model=cnn", "data=synthetic"]
    check_command_line([*base, "amp=false,true", "seed=0,1"])
    BasicSweeper.validate_batch_is_legal(None, ["checked"])
    check_command_line([*base, "seed=range(0,65)"])
    BasicSweeper.validate_batch_is_legal(None, ["unseen"])
    assert asked == [["unseen"]]


@pytest.mark.parametrize(
    "args",
    [
        ["-m", "amp=false,true"],
        ["--multirun", "seed=0,1", "--config-dir=/tmp/conf"],
        ["--cfg", "job", "epochs=1"],
        ["-cd", "/tmp/conf", "-cn", "config", "optim.lr=-1"],
        ["hydra.run.dir=/tmp/x", "data.root=", "epochs=1"],
        ["--help"],
    ],
)
def test_valid_command_lines_are_no_slips(args):
    assert override_slip(args) is None


def test_the_machine_is_not_checked_for_jobs_a_cluster_runs():
    """device=cuda on a login node without a GPU: the slurm jobs run on nodes that have one."""
    from trainer.command_line import runs_here

    assert runs_here(["device=cuda"], []) and runs_here(["-m", "seed=0,1"], ["hydra/launcher=parallel"])
    assert not runs_here(["device=cuda", "hydra/launcher=slurm"], ["hydra/launcher=slurm"])
    assert not runs_here(["--cfg", "job"], [])


def test_a_downloaded_cifar_archive_needs_no_network(tmp_path, monkeypatch):
    from trainer import preflight

    monkeypatch.setattr(preflight, "reachable", lambda host: False)
    cfg = to_train_config(compose_config("data=cifar10", f"data.root={tmp_path}"))
    with pytest.raises(ConfigError, match="cannot be reached to download it"):
        preflight.check_data(cfg)
    (tmp_path / preflight.CIFAR10_ARCHIVE).write_bytes(b"")
    preflight.check_data(cfg)  # torchvision extracts the archive without a download
