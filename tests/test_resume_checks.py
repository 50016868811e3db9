"""Resuming from a checkpoint that does not fit the run is refused in one line that says what
differs and what to set, before anything is written; a partial save is cleaned up; a finished
run resumed still leaves a checkpoint."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FINISHED, SMALL, compose_config, read_metrics, run_cli, run_folders
from PIL import Image

from trainer import Trainer
from trainer.config import ConfigError, ModelConfig, ModelName
from trainer.models import build_model
from trainer.perf import DDP_TOGGLES


@pytest.fixture(scope="module")
def two_classes(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("two-classes")
    generator = torch.Generator().manual_seed(0)
    for split in ("train", "test"):
        for label in range(2):
            (root / split / f"class{label}").mkdir(parents=True)
            for index in range(4):
                pixels = torch.randint(0, 256, (32, 32, 3), generator=generator, dtype=torch.uint8)
                Image.fromarray(pixels.numpy()).save(root / split / f"class{label}" / f"{index}.png")
    return root


def refusal(overrides: list[str], run_dir: Path) -> str:
    """The one-line error a resume with these overrides stops with, after checking that it
    left no checkpoint and a metrics.json that says failed."""
    with pytest.raises(ConfigError) as caught:
        Trainer.for_run(compose_config(*overrides), run_dir, overrides).fit()
    assert "\n" not in str(caught.value)
    assert not (run_dir / "checkpoints").exists()
    assert read_metrics(run_dir)["status"] == "failed"
    return str(caught.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["optim=adamw"], "was saved with optim.name=sgd, this config has adamw: set optim=sgd"),
        (["model=resnet18"], "was saved with model.name=cnn, this config has resnet18: set model=cnn"),
        (
            ["optim.schedule=cosine"],
            "was saved with optim.schedule=onecycle, this config has cosine: set optim.schedule=onecycle",
        ),
        (
            ["data=imagefolder", "data.root={two_classes}", "batch_size=2"],
            "was trained on 10 classes, this data has 2: resume on the data it was trained on "
            "(data=synthetic)",
        ),
        (
            ["optim.lr=0.5"],
            "was saved with optim.lr=0.02, this config has 0.5: a resume trains with the "
            "checkpoint's optim.lr, so set optim.lr=0.02, or start a new run without resume",
        ),
        (["seed=3"], "was saved with seed=0, this config has 3: a resume trains with the checkpoint's seed"),
        (["fused_optimizer=true"], "was saved with fused_optimizer=false, this config has true"),
    ],
    ids=["optimizer", "model", "schedule", "class-count", "lr", "seed", "fused"],
)
def test_a_resume_that_does_not_fit_says_what_to_set(tmp_path, finished_run, two_classes, overrides, message):
    overrides = [override.format(two_classes=two_classes) for override in overrides]

    line = refusal([*FINISHED, *overrides, f"resume={finished_run}"], tmp_path / "resumed")

    assert line.startswith(f"resume={finished_run} ")
    assert message in line


def test_resuming_without_conv_biases_from_a_run_with_them_says_to_keep_them(tmp_path, finished_run):
    """A resnet18 checkpoint with conv biases: the finished run's, its model swapped (no
    resnet18 step is needed to show the refusal, and one costs seconds on a CPU)."""
    state = torch.load(finished_run / "checkpoints" / "last.pt", weights_only=False)
    state["model"] = build_model(ModelConfig(name=ModelName.resnet18, conv_bias=True), 10).state_dict()
    state["config"]["model"].update(name="resnet18", conv_bias=True, sgd_lr=0.1)
    state["config"]["optim"]["lr"] = 0.1  # resnet18's own (model.sgd_lr): only conv_bias differs
    with_biases = tmp_path / "with-biases.pt"
    torch.save(state, with_biases)

    overrides = [*FINISHED, "model=resnet18", "model.conv_bias=false", f"resume={with_biases}"]
    line = refusal(overrides, tmp_path / "resumed")

    assert "was saved with model.conv_bias=true, a different set of weights: set model.conv_bias=true" in line


def test_a_plain_state_dict_is_not_taken_for_a_checkpoint(tmp_path, finished_run):
    weights = tmp_path / "weights.pt"
    torch.save(torch.load(finished_run / "checkpoints" / "last.pt", weights_only=False)["model"], weights)

    line = refusal([*FINISHED, f"resume={weights}"], tmp_path / "resumed")

    assert f"resume={weights} is not a checkpoint written by this trainer (no model, optimizer" in line
    assert "give a run folder or its checkpoints/last.pt" in line


def test_a_saved_state_that_does_not_load_names_which_and_how_to_resume(tmp_path, finished_run):
    state = torch.load(finished_run / "checkpoints" / "last.pt", weights_only=False)
    state["optimizer"]["param_groups"] = []
    tampered = tmp_path / "tampered.pt"
    torch.save(state, tampered)

    line = refusal([*FINISHED, f"resume={tampered}"], tmp_path / "resumed")

    assert "the saved optimizer state does not fit this run" in line
    assert "resume with the settings it was saved with" in line


def partial_save(run_dir: Path, pid: int) -> Path:
    """The temporary file a checkpoint save by process `pid` on this host leaves when killed midway."""
    partial = run_dir / "checkpoints" / f"last.pt.{socket.gethostname()}.{pid}.tmp"
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_bytes(b"half a checkpoint")
    return partial


def ended_process() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_resuming_a_finished_run_leaves_its_checkpoint_and_removes_a_partial_save(tmp_path, finished_run):
    """A save killed midway (kill -9) leaves its temporary file; the next start or resume
    removes it once its writer has ended, and never one whose writer still runs."""
    partial = partial_save(finished_run, ended_process())
    in_flight = partial_save(finished_run, os.getpid())  # this process is alive: it may be mid-write

    metrics = Trainer(compose_config(*FINISHED, f"resume={finished_run}"), tmp_path / "resumed").fit()

    assert not partial.exists()
    assert in_flight.exists()
    in_flight.unlink()
    assert (metrics["status"], metrics["steps"]) == ("completed", 2)
    assert metrics["history"] == read_metrics(finished_run)["history"]
    saved = torch.load(tmp_path / "resumed" / "checkpoints" / "last.pt", weights_only=False)
    assert saved["step"] == 2


def test_a_failed_runs_record_removes_a_metrics_write_its_killed_rank_left(tmp_path, monkeypatch):
    """A rank stopped by the launcher amid writing metrics.json leaves its temporary file: the
    failure record written after the ranks have ended removes it (never a live writer's)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    killed = run_dir / f"metrics.json.{socket.gethostname()}.{ended_process()}.tmp"
    killed.write_text('{"status": "run')
    monkeypatch.setattr(
        "trainer.loop.train", lambda *args: (_ for _ in ()).throw(RuntimeError("rank 1 failed"))
    )

    with pytest.raises(RuntimeError):
        Trainer(compose_config("max_steps=1"), run_dir).fit()

    assert not killed.exists()
    assert read_metrics(run_dir)["status"] == "failed"


def test_a_new_run_in_a_folder_with_a_partial_save_removes_it(tmp_path):
    partial = partial_save(tmp_path / "run", ended_process())

    Trainer(compose_config("max_steps=1"), tmp_path / "run").build()

    assert not partial.exists()


def test_a_resume_of_another_length_is_refused_before_torch_and_a_run_folder(tmp_path):
    """From the command line, the saved settings are read from the run's .hydra/config.yaml:
    one line naming what to set, exit 2, no new folder."""
    saved = run_cli(*SMALL, "max_steps=2", cwd=tmp_path)
    assert saved.returncode == 0, saved.stderr
    [run] = run_folders(tmp_path / "outputs")
    resumed = run_cli(*SMALL, "max_steps=2", "epochs=3", f"resume='{run}'", cwd=tmp_path)
    assert resumed.returncode == 2, resumed.stdout + resumed.stderr
    [line] = [line for line in resumed.stderr.splitlines() if line.strip()]
    assert line == (
        f"trainer: error: resume={run} was saved with epochs=1, which this config changes: "
        "set epochs=1 as saved, or start a new run without resume"
    )
    assert run_folders(tmp_path / "outputs") == [run]


# What each setting does on resume, other than those the checkpoint decides (RESTORED_SETTINGS):
STATE_SHAPING_SETTINGS = (
    "model.name",
    "model.target",
    "model.conv_bias",
    "optim.name",
    "optim.schedule",
    "ema.enabled",
)  # refused: what the checkpoint holds has their shape
STEP_SETTINGS = (
    "epochs",
    "max_steps",
    "batch_size",
    "grad_accum_steps",
    "data.train_size",
    "devices",
    "ddp",
)  # refused where they change the schedule's length in steps
APPLIED_SETTINGS = (  # read afresh by the resumed run: a change applies, and is recorded as applied
    "model.grad_checkpointing",
    "data.source",
    "data.root",
    "data.download",
    "data.test_size",
    "data.augment",
    "data.crop_padding",
    "data.padding_mode",
    "data.flip",
    "data.loader",
    "data.decode",
    "data.decode_cache",
    "data.prefetch",
    "data.cutout",
    "data.low_res",
    "data.low_res_epochs",
    "optim.label_smoothing",
    "optim.muon_fixed_norm",  # read from the config when the optimizer is built, not saved
    "eval.tta",
    "eval.from_epoch",
    "eval.tta_unsure",
    "ema.decay",
    "ema.update_every",
    "device",
    "eval_every",
    "resume",
    "deterministic",
    "log_every",
    "tb_step",
    "target_acc",
    "export",
    "amp",
    "amp_dtype",
    "set_to_none",
    "num_workers",
    "pin_memory",
    "persistent_workers",
    "prefetch_factor",
    "non_blocking",
    "channels_last",
    "cudnn_benchmark",
    "tf32",
    "compile",
    "compile_mode",
    "compile_optimizer",
    "step_graph",
    "measure_data_wait",
    "profile",
    *DDP_TOGGLES,
    "ddp_shard_muon",  # the same updates, worked out by one rank or shared out
    "data_parallel",
)


def test_every_setting_either_applies_on_resume_or_is_refused_when_changed():
    """R10: no field of the schema is left unclassified; a new one fails here until it is."""
    from omegaconf import OmegaConf

    from trainer.checkpoint import RESTORED_SETTINGS, STATE_SHAPING
    from trainer.config import TrainConfig
    from trainer.logging import flatten

    fields = set(flatten(OmegaConf.to_container(OmegaConf.structured(TrainConfig))))
    groups = [RESTORED_SETTINGS, STATE_SHAPING_SETTINGS, STEP_SETTINGS, APPLIED_SETTINGS]
    classified = [key for group in groups for key in group]
    assert len(classified) == len(set(classified)), "a setting in two lists"
    assert set(classified) == fields, (fields - set(classified), set(classified) - fields)
    assert {f"{group}.{key}" for group, key in STATE_SHAPING} <= set(STATE_SHAPING_SETTINGS)


def test_a_changed_lr_on_resume_is_refused_before_anything_trains(tmp_path, finished_run):
    """The reproducer of R10: the new lr would be logged and recorded, the saved one trained with."""
    line = refusal([*FINISHED, "optim.lr=0.5", f"resume={finished_run}"], tmp_path / "resumed")
    assert "optim.lr=0.02, this config has 0.5" in line
