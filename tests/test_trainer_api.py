"""`Trainer(cfg, run_dir).fit()` from Python: metrics, step limits, evaluation cadence,
checkpoints, and a resume that ends bit-for-bit where an uninterrupted run ends."""

from __future__ import annotations

import resource
import signal
import threading
from pathlib import Path

import pytest
import torch
from conftest import HANG_GUARD_S, compose_config, read_metrics

from trainer import Trainer, checkpoint
from trainer.config import ConfigError

# 256 synthetic images / batch 32 = 8 optimizer steps per epoch (see conftest.SMALL).
STEPS_PER_EPOCH = 8
RESUMABLE = ("deterministic=true", "epochs=2")


def load_checkpoint(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)


def assert_same_weights(expected: dict, actual: dict) -> None:
    assert expected.keys() == actual.keys()
    for name, tensor in expected.items():
        assert torch.equal(tensor, actual[name]), name


@pytest.fixture(autouse=True, scope="module")
def restore_deterministic_mode():
    """deterministic=true switches torch into deterministic mode for the whole process."""
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


class StopAfterFirstEvaluation(Trainer):
    """Sends itself SIGTERM once the first epoch has been evaluated, as `kill` would."""

    def evaluate(self) -> dict:
        result = super().evaluate()
        if self.progress.epoch == 1:
            signal.raise_signal(signal.SIGTERM)
        return result


def test_fit_returns_what_it_writes_to_metrics_json(tmp_path):
    metrics = Trainer(compose_config(), tmp_path / "run").fit()

    assert metrics["status"] == "completed"
    assert metrics["epochs"] == 1
    assert metrics["steps"] == STEPS_PER_EPOCH
    assert metrics == read_metrics(tmp_path / "run")


def test_max_steps_stops_after_exactly_that_many_optimizer_steps(tmp_path):
    # AdamW counts its own steps in its state: a witness independent of the Trainer's counter.
    metrics = Trainer(compose_config("max_steps=3", "optim=adamw"), tmp_path / "run").fit()

    assert metrics["status"] == "completed"
    assert metrics["steps"] == 3
    saved = load_checkpoint(tmp_path / "run")
    assert saved["step"] == 3
    assert {float(state["step"]) for state in saved["optimizer"]["state"].values()} == {3.0}
    assert saved["scheduler"]["last_epoch"] == 3
    assert metrics["test_acc"] is not None  # stopping early still ends with an evaluation


def test_eval_every_evaluates_every_nth_epoch_and_after_the_last(tmp_path):
    cfg = compose_config("epochs=3", "eval_every=2", "data.train_size=64")

    metrics = Trainer(cfg, tmp_path / "run").fit()

    evaluated = {record["epoch"]: record["test_acc"] for record in metrics["history"] if "test_acc" in record}
    assert list(evaluated) == [2, 3]
    assert metrics["test_acc"] == evaluated[3]
    assert metrics["best_test_acc"] == max(evaluated.values())


def test_checkpoint_holds_everything_a_resume_needs_and_no_temporary_file_is_left(tmp_path):
    Trainer(compose_config(), tmp_path / "run").fit()

    saved = load_checkpoint(tmp_path / "run")
    assert {"model", "optimizer", "scheduler", "scaler", "epoch", "step", "rng", "config"} <= saved.keys()
    assert (saved["epoch"], saved["step"]) == (1, STEPS_PER_EPOCH)
    assert saved["config"]["model"]["name"] == "cnn"
    assert {"torch", "numpy", "python"} <= saved["rng"].keys()
    assert list((tmp_path / "run").rglob("*.tmp")) == []


def test_a_save_that_fails_keeps_the_previous_checkpoint_and_says_why_in_one_line(tmp_path, monkeypatch):
    """The second save meets a file-size limit (as it would a full disk): the first checkpoint
    stays, the partial file goes, and the error names the file and the reason."""
    real_write = checkpoint.write_atomic
    writes = []

    def write_under_a_file_size_limit_the_second_time(*args, **kwargs):
        writes.append(threading.current_thread() is not threading.main_thread())
        if len(writes) < 2:
            return real_write(*args, **kwargs)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
        try:
            return real_write(*args, **kwargs)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

    monkeypatch.setattr(checkpoint, "write_atomic", write_under_a_file_size_limit_the_second_time)

    with pytest.raises(checkpoint.CheckpointNotWritten) as caught:
        Trainer(compose_config("epochs=2"), tmp_path / "run").fit()

    last = tmp_path / "run" / "checkpoints" / "last.pt"
    assert str(caught.value).startswith(f"could not write the checkpoint {last} (File too large)")
    assert "\n" not in str(caught.value)
    assert load_checkpoint(tmp_path / "run")["epoch"] == 1
    assert list((tmp_path / "run").rglob("*.tmp")) == []
    assert read_metrics(tmp_path / "run")["status"] == "failed"
    assert writes == [True, True]  # both written beside the training, the error raised all the same


def test_a_checkpoint_is_written_beside_the_training_and_on_disk_once_waited_for(tmp_path, monkeypatch):
    """save() returns with the file still being written (the write is held here until released);
    wait() returns once it is whole, holding the state as of the save, not as of the write."""
    released, real_write = threading.Event(), checkpoint.write_atomic

    def held_write(*args, **kwargs):
        assert released.wait(HANG_GUARD_S)
        real_write(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "write_atomic", held_write)
    model, path = torch.nn.Linear(2, 2), tmp_path / "last.pt"
    saver = checkpoint.Saver()
    saver.save(path, {"model": model}, step=1)
    saved_weight = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)  # the next epoch's training, while the write waits
    assert not path.exists()
    released.set()
    saver.wait()
    assert torch.equal(torch.load(path, weights_only=False)["model"]["weight"], saved_weight)
    assert list(tmp_path.glob("*.tmp")) == []


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    Trainer(compose_config(*RESUMABLE), run_dir).fit()
    return run_dir


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> tuple[Path, dict, bool]:
    """(run folder, metrics, whether fit() put the SIGTERM handler back)."""
    run_dir = tmp_path_factory.mktemp("interrupted") / "run"
    handler_before = signal.getsignal(signal.SIGTERM)
    metrics = StopAfterFirstEvaluation(compose_config(*RESUMABLE), run_dir).fit()
    return run_dir, metrics, signal.getsignal(signal.SIGTERM) is handler_before


def test_sigterm_stops_at_the_epoch_boundary_with_a_checkpoint(interrupted):
    run_dir, metrics, handler_restored = interrupted

    assert handler_restored
    assert metrics["status"] == "interrupted"
    assert (metrics["epochs"], metrics["steps"]) == (1, STEPS_PER_EPOCH)
    assert read_metrics(run_dir)["status"] == "interrupted"
    saved = load_checkpoint(run_dir)
    assert (saved["epoch"], saved["step"]) == (1, STEPS_PER_EPOCH)


@pytest.mark.parametrize("point_at", ["run folder", "checkpoint file"])
def test_resumed_run_ends_with_the_uninterrupted_runs_weights(tmp_path, uninterrupted, interrupted, point_at):
    interrupted_dir, interrupted_metrics, _ = interrupted
    resume = interrupted_dir if point_at == "run folder" else interrupted_dir / "checkpoints" / "last.pt"

    metrics = Trainer(compose_config(*RESUMABLE, f"resume={resume}"), tmp_path / "resumed").fit()

    assert metrics["status"] == "completed"
    assert (metrics["epochs"], metrics["steps"]) == (2, 2 * STEPS_PER_EPOCH)
    # Another run's checkpoint: absolute (one inside the run folder is relative to it)
    assert metrics["resumed_from"] == str((interrupted_dir / "checkpoints" / "last.pt").resolve())
    assert [record["epoch"] for record in metrics["history"]] == [1, 2]
    # Epoch 1 is carried over from the checkpoint, not trained again: even its timings match.
    assert metrics["history"][0] == interrupted_metrics["history"][0]
    resumed_weights = load_checkpoint(tmp_path / "resumed")["model"]
    assert_same_weights(load_checkpoint(uninterrupted)["model"], resumed_weights)
    assert metrics["test_acc"] == read_metrics(uninterrupted)["test_acc"]


def test_a_stop_on_the_last_step_of_an_epoch_keeps_that_epochs_record(tmp_path, uninterrupted):
    """A stop that lands on an epoch's last step is a stop at the epoch's end: the epoch is
    counted and evaluated, and the resumed run does not record it again."""
    trainer = Trainer(compose_config(*RESUMABLE), tmp_path / "run").build()
    steps_taken = []

    def stop_after_the_first_epochs_last_step(*_):
        steps_taken.append(1)
        if len(steps_taken) == STEPS_PER_EPOCH:
            signal.raise_signal(signal.SIGTERM)

    trainer.optimizer.register_step_post_hook(stop_after_the_first_epochs_last_step)
    metrics = trainer.fit()

    assert metrics["status"] == "interrupted"
    assert (metrics["epochs"], metrics["steps"]) == (1, STEPS_PER_EPOCH)
    resumed = Trainer(compose_config(*RESUMABLE, f"resume={tmp_path / 'run'}"), tmp_path / "resumed").fit()
    assert resumed["status"] == "completed"
    assert resumed["history"][0]["train_loss"] == read_metrics(uninterrupted)["history"][0]["train_loss"]
    assert_same_weights(
        load_checkpoint(uninterrupted)["model"], load_checkpoint(tmp_path / "resumed")["model"]
    )


def test_resuming_with_a_longer_schedule_is_refused_in_one_line(tmp_path, uninterrupted):
    """The checkpoint's LR schedule has its own length; a resume that would run past it is
    refused with the saved settings named, not left to fail a step past the schedule."""
    cfg = compose_config("deterministic=true", "epochs=3", f"resume={uninterrupted}")

    with pytest.raises(ConfigError, match="epochs") as caught:
        Trainer(cfg, tmp_path / "resumed").fit()

    assert "\n" not in str(caught.value)
    assert read_metrics(tmp_path / "resumed")["status"] == "failed"


def test_a_run_failing_mid_epoch_reports_the_steps_its_checkpoint_holds(tmp_path, monkeypatch):
    from trainer import loop

    step = loop.optimizer_step

    def fail_in_epoch_two(parts, progress):
        if progress.step == STEPS_PER_EPOCH + 2:
            raise RuntimeError("a device error in epoch 2")
        step(parts, progress)

    monkeypatch.setattr(loop, "optimizer_step", fail_in_epoch_two)
    with pytest.raises(RuntimeError, match="a device error"):
        Trainer(compose_config(*RESUMABLE), tmp_path).fit()
    metrics = read_metrics(tmp_path)
    assert metrics["status"] == "failed" and len(metrics["history"]) == 1
    assert metrics["steps"] == load_checkpoint(tmp_path)["step"] == STEPS_PER_EPOCH
