"""`python -m trainer` end to end: the run folder, metrics.json, TensorBoard scalars, and a `-m` sweep."""

from __future__ import annotations

import math
import re

import torch
from conftest import SMALL, TOGGLE_SWEEP, read_metrics, run_cli, run_folders
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

TAGS = ("train/loss", "train/acc", "test/loss", "test/acc", "lr", "perf/img_per_s", "perf/epoch_s")
TIMESTAMP = r"\d{4}-\d{2}-\d{2}/\d{2}-\d{2}-\d{2}\.\d{6}"  # <date>/<time with microseconds>


def scalars(run) -> dict[str, list[tuple[int, float]]]:
    """Every TensorBoard scalar of the run: tag -> [(step, value), ...]."""
    events = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_a_run_leaves_one_folder_with_checkpoint_metrics_and_tensorboard(tmp_path):
    overrides = [*SMALL, "epochs=2"]  # 256 images / batch 32: 8 steps per epoch, loss logged every 2

    result = run_cli(*overrides, cwd=tmp_path)

    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    [run] = run_folders(tmp_path / "outputs")
    assert re.fullmatch(TIMESTAMP, run.relative_to(tmp_path / "outputs").as_posix())
    assert (run / ".hydra" / "config.yaml").is_file()
    assert (run / "tb").is_dir()
    assert (run / "checkpoints" / "last.pt").is_file()

    metrics = read_metrics(run)
    assert metrics["status"] == "completed"
    assert metrics["epochs"] == 2
    assert metrics["steps"] == 16
    assert 0.0 <= metrics["test_acc"] <= metrics["best_test_acc"] <= 1.0
    assert math.isfinite(metrics["train_loss"]) and metrics["train_loss"] > 0
    assert metrics["img_per_s"] > 0
    assert metrics["train_time_s"] > 0
    assert metrics["peak_mem_mb"] is None  # CUDA-only measurement
    assert metrics["device"] == "cpu"
    assert metrics["overrides"] == overrides
    assert torch.load(run / "checkpoints" / "last.pt", weights_only=False)["step"] == 16

    logged = scalars(run)
    assert set(TAGS) <= set(logged)
    assert [step for step, _ in logged["train/loss"]] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert all(math.isfinite(loss) and loss > 0 for _, loss in logged["train/loss"])
    assert all(lr > 0 for _, lr in logged["lr"])
    assert [step for step, _ in logged["test/acc"]] == [8, 16]
    assert all(0.0 <= accuracy <= 1.0 for _, accuracy in logged["test/acc"])
    assert math.isclose(logged["test/acc"][-1][1], metrics["test_acc"], rel_tol=1e-6)  # TB holds float32
    assert all(0.0 <= accuracy <= 1.0 for _, accuracy in logged["train/acc"])
    assert all(value > 0 for _, value in logged["perf/img_per_s"] + logged["perf/epoch_s"])
    assert len(logged["perf/epoch_s"]) == 2


def test_a_sweep_leaves_one_completed_folder_per_job(toggle_sweep):
    outputs = toggle_sweep.parents[2]  # <cwd>/outputs/multirun/<date>/<time>
    runs = run_folders(toggle_sweep)
    settings = [(amp, layout) for amp in (False, True) for layout in (False, True)]  # Hydra's job order
    assert len(set(runs)) == len(settings)
    for job, (run, (amp, layout)) in enumerate(zip(runs, settings)):
        assert re.fullmatch(f"multirun/{TIMESTAMP}/{job}", run.relative_to(outputs).as_posix())
        metrics = read_metrics(run)
        assert metrics["status"] == "completed"
        assert metrics["overrides"] == [*TOGGLE_SWEEP, f"amp={amp}", f"channels_last={layout}"]
        assert metrics["steps"] == 4  # 2 epochs of 64 images / batch 32
        assert (run / "checkpoints" / "last.pt").is_file()
