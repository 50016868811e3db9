"""Every bad value costs one line that names its key, a non-zero exit, no traceback and no
checkpoint. Run in-process through the command line's own entry point: `main()` with these
arguments, and where its checks let a case through, the job itself (`run`) as Hydra would start
it. test_cli_errors.py runs a few of the same through a real subprocess.
"""

from __future__ import annotations

import logging
import math
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import SMALL, compose_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trainer.__main__ as cli
from trainer.config import ConfigError, to_train_config
from trainer.trainer import Trainer

# case id -> (overrides after SMALL, the key its error line must name); {file} is a regular
# file, {weights} a plain state_dict, {finished} a finished run of the cnn with SGD.
BAD_VALUES = {
    "epochs-zero": (["epochs=0"], "epochs"),
    "epochs-negative": (["epochs=-1"], "epochs"),
    "epochs-fraction": (["epochs=1.5"], "epochs"),
    "batch-zero": (["batch_size=0"], "batch_size"),
    "batch-negative": (["batch_size=-8"], "batch_size"),
    "batch-word": (["batch_size=abc"], "batch_size"),
    "batch-above-the-dataset": (["batch_size=512"], "batch_size"),
    "accumulation-zero": (["grad_accum_steps=0"], "grad_accum_steps"),
    "eval-every-zero": (["eval_every=0"], "eval_every"),
    "log-every-zero": (["log_every=0"], "log_every"),
    "max-steps-zero": (["max_steps=0"], "max_steps"),
    "max-steps-negative": (["max_steps=-3"], "max_steps"),
    "workers-negative": (["num_workers=-1"], "num_workers"),
    "prefetch-zero": (["num_workers=2", "prefetch_factor=0"], "prefetch_factor"),
    "persistent-without-workers": (["num_workers=0", "persistent_workers=true"], "persistent_workers"),
    "workers-not-a-number": (["num_workers=many"], "num_workers"),
    "devices-zero": (["devices=0"], "devices"),
    "ddp-on-cpu-without-devices": (["ddp=true", "device=cpu"], "devices"),
    "nccl-on-cpu": (["ddp=true", "devices=2", "device=cpu", "ddp_backend=nccl"], "ddp_backend"),
    "device-word": (["device=gpu"], "device"),
    "device-index-word": (["device=cuda:x"], "device"),
    "seed-negative": (["seed=-1"], "seed"),
    "seed-too-large": (["seed=4294967296"], "seed"),
    "seed-fraction": (["seed=1.5"], "seed"),
    "lr-negative": (["optim.lr=-1"], "optim.lr"),
    "lr-nan": (["optim.lr=nan"], "optim.lr"),
    "lr-infinite": (["optim.lr=inf"], "optim.lr"),
    "lr-word": (["optim.lr=abc"], "optim.lr"),
    "lr-diverges": (["optim.lr=1e30"], "optim.lr"),
    "weight-decay-negative": (["optim.weight_decay=-1"], "optim.weight_decay"),
    "adamw-weight-decay-negative": (["optim=adamw", "optim.weight_decay=-0.1"], "optim.weight_decay"),
    "momentum-negative": (["optim.momentum=-1"], "optim.momentum"),
    "momentum-one": (["optim.momentum=1"], "optim.momentum"),
    "nesterov-without-momentum": (["optim.momentum=0"], "optim.momentum"),
    "beta-above-one": (["optim=adamw", "optim.betas=[1.5,0.999]"], "optim.betas"),
    "one-beta": (["optim=adamw", "optim.betas=[0.9]"], "optim.betas"),
    "three-betas": (["optim.betas=[0.9,0.99,0.999]"], "optim.betas"),
    "betas-not-a-list": (["optim.betas=0.9"], "optim.betas"),
    "beta-word": (["optim.betas=[0.9,x]"], "optim.betas"),
    "warmup-zero": (["optim.warmup_frac=0"], "optim.warmup_frac"),
    "warmup-whole": (["optim.warmup_frac=1"], "optim.warmup_frac"),
    "label-smoothing-negative": (["optim.label_smoothing=-0.1"], "optim.label_smoothing"),
    "label-smoothing-one": (["optim.label_smoothing=1"], "optim.label_smoothing"),
    "optimizer-unknown": (["optim.name=rmsprop"], "optim.name"),
    "optimizer-group-unknown": (["optim=rmsprop"], "optim"),
    "schedule-unknown": (["optim.schedule=exponential"], "optim.schedule"),
    "amp-word": (["amp=maybe"], "amp"),
    "amp-dtype-unknown": (["amp_dtype=fp8"], "amp_dtype"),
    "compile-mode-unknown": (["compile_mode=fastest"], "compile_mode"),
    "ddp-backend-unknown": (["ddp_backend=mpi"], "ddp_backend"),
    "loader-unknown": (["data.loader=cuda"], "data.loader"),
    "gpu-loader-with-workers": (["data.loader=gpu", "num_workers=2"], "num_workers"),
    "train-size-zero": (["data.train_size=0"], "data.train_size"),
    "test-size-negative": (["data.test_size=-1"], "data.test_size"),
    "cifar10-without-root": (["data=cifar10", "data.root=null"], "data.root"),
    "model-unknown": (["model=resnet19"], "model"),
    "typo": (["ampp=true"], "ampp"),
    "resume-missing": (["resume=/does/not/exist"], "resume"),
    "resume-plain-state-dict": (["resume={weights}"], "resume"),
    "resume-other-optimizer": (["optim=adamw", "max_steps=2", "resume={finished}"], "optim"),
    "run-folder-under-a-file": (["hydra.run.dir={file}/run"], "hydra.run.dir"),
    "sweep-folder-under-a-file": (["-m", "seed=0,1", "hydra.sweep.dir={file}/sweep"], "hydra.sweep.dir"),
}


@pytest.fixture(scope="module")
def placeholders(tmp_path_factory, finished_run) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("placeholders")
    (folder / "a-file").write_text("not a folder")
    torch.save({"weight": torch.zeros(2)}, folder / "weights.pt")
    return {
        "file": str(folder / "a-file"),
        "weights": str(folder / "weights.pt"),
        "finished": str(finished_run),
    }


def outcome(args: list[str], cwd: Path, monkeypatch, capsys, caplog) -> tuple[int, list[str]]:
    """(exit code, the non-empty lines it printed or logged) of `python -m trainer ARGS` in cwd.

    The checks before Hydra print on stderr and exit 2; a case they let through runs as the
    job Hydra would start, in cwd/run, and fails there with one logged error and exit 1.
    """

    def job_in_cwd() -> None:
        overrides = [arg for arg in args if not arg.startswith(("-", "hydra"))]
        cli.run(compose_config(*overrides, small=False), str(cwd / "run"), overrides)

    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["trainer", *args])
    monkeypatch.setattr(cli, "train", job_in_cwd)
    caplog.set_level(logging.WARNING)
    with pytest.raises(SystemExit) as exited:
        cli.main()
    out, err = capsys.readouterr()
    problems = [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]
    lines = [line for line in (out + err).splitlines() if line.strip()] + problems
    return exited.value.code, lines


@pytest.mark.parametrize("case", BAD_VALUES)
def test_a_bad_value_is_one_line_naming_its_key(case, placeholders, tmp_path, monkeypatch, capsys, caplog):
    overrides, key = BAD_VALUES[case]
    overrides = [override.format(**placeholders) for override in overrides]
    args = [*overrides[:1], *SMALL, *overrides[1:]] if overrides[0] == "-m" else [*SMALL, *overrides]

    code, lines = outcome(args, tmp_path, monkeypatch, capsys, caplog)

    assert code not in (0, None)
    assert len(lines) == 1, lines
    assert "Traceback" not in lines[0]
    assert key in lines[0]
    assert [*tmp_path.rglob("*.pt"), *tmp_path.rglob("*.tmp")] == []


def writable(folder: Path) -> bool:
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


@pytest.mark.skipif(not Path("/sys").is_dir() or writable(Path("/sys")), reason="no read-only /sys here")
@pytest.mark.parametrize("run_dir", ["/sys/trainer-run", "/sys/kernel"], ids=["parent", "folder"])
def test_a_read_only_run_folder_is_refused_before_hydra(run_dir, tmp_path, monkeypatch, capsys, caplog):
    """Hydra's traceback otherwise: PermissionError making the folder under a read-only parent,
    'Unable to configure handler file' in a read-only folder. /sys is read-only for root too."""
    code, lines = outcome([*SMALL, f"hydra.run.dir={run_dir}"], tmp_path, monkeypatch, capsys, caplog)

    looked_in = run_dir if Path(run_dir).exists() else "/sys"
    assert code == 2
    assert lines == [
        f"trainer: error: cannot make the run folder {run_dir}: nothing can be written in {looked_in} "
        "(Permission denied): set hydra.run.dir=/a/writable/folder"
    ]


def test_a_learning_rate_of_zero_is_allowed_with_a_warning(tmp_path, caplog):
    caplog.set_level(logging.WARNING)

    Trainer(compose_config("optim.lr=0"), tmp_path / "run").build()

    assert [record.getMessage() for record in caplog.records if record.name == "trainer.optim"] == [
        "optim.lr=0: the weights will not change; set e.g. optim.lr=0.05 to train"
    ]


NUMERIC_KEYS = {
    ("optim", "lr"): st.floats(allow_nan=True, allow_infinity=True),
    ("optim", "weight_decay"): st.floats(allow_nan=True, allow_infinity=True),
    ("optim", "momentum"): st.floats(allow_nan=True, allow_infinity=True),
    ("optim", "warmup_frac"): st.floats(allow_nan=True, allow_infinity=True),
    ("optim", "label_smoothing"): st.floats(allow_nan=True, allow_infinity=True),
    ("optim", "betas"): st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=3),
    (None, "seed"): st.integers(min_value=-(2**70), max_value=2**70),
    (None, "epochs"): st.integers(min_value=-(2**40), max_value=2**40),
    (None, "batch_size"): st.integers(min_value=-(2**40), max_value=2**40),
    (None, "max_steps"): st.none() | st.integers(min_value=-(2**40), max_value=2**40),
}


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(st.sampled_from(list(NUMERIC_KEYS)).flatmap(lambda key: st.tuples(st.just(key), NUMERIC_KEYS[key])))
def test_any_number_is_accepted_or_refused_in_one_line_naming_its_key(key_and_value):
    (group, name), value = key_and_value
    config = {"data": {"source": "synthetic"}}
    if group:
        config[group] = {name: value}
    else:
        config[name] = value
    dotted = f"{group}.{name}" if group else name

    try:
        accepted = to_train_config(config)
    except ConfigError as error:
        assert dotted in str(error) and "\n" not in str(error)
        return
    stored = getattr(getattr(accepted, group) if group else accepted, name)
    numbers = stored if isinstance(stored, list) else [stored]
    assert all(number is None or math.isfinite(number) for number in numbers)
