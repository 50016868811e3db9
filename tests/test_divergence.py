"""A run that does not learn says so: a loss that grows a hundredfold stops the run, a test
accuracy at chance after its epochs marks it; both `diverged` in metrics.json, one line naming
what to lower. And the cnn trains at an lr it learns at."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from conftest import compose_config, read_metrics, run_cli

from trainer import Trainer, loop
from trainer.config import to_train_config
from trainer.progress import Progress


def test_the_cnn_takes_its_own_sgd_lr_unless_one_is_given():
    assert to_train_config(compose_config("model=cnn", small=False)).optim.lr == 0.02
    assert to_train_config(compose_config("model=resnet18", small=False)).optim.lr == 0.1
    assert to_train_config(compose_config("model=cnn", "optim.lr=0.3", small=False)).optim.lr == 0.3
    assert to_train_config(compose_config("model=cnn", "optim=adamw", small=False)).optim.lr == 0.001


def windows(*means: float) -> None:
    """log_window over windows of these mean losses, with stand-ins for the run's parts."""
    import torch

    parts = SimpleNamespace(
        grad_accum_steps=1,
        images_per_micro_batch=32,
        scheduler=SimpleNamespace(get_last_lr=lambda: [0.1]),
        mfu=SimpleNamespace(utilization=lambda *_: None),
        non_finite_advice="lower optim.lr (now 0.1, a peak of 0.1 at this batch)",
    )
    progress = Progress()
    run = SimpleNamespace(log=SimpleNamespace(scalars=lambda *_: None))
    bar = SimpleNamespace(set_postfix=lambda **_: None)
    for mean in means:
        progress.step += 2
        loop.log_window(parts, progress, run, [torch.tensor(mean), torch.tensor(mean)], bar, 0.0)


def test_a_loss_that_grows_a_hundredfold_stops_the_run():
    windows(2.3, 5.0, 200.0)  # 87x: a bad stretch, not yet a divergence
    with pytest.raises(loop.LossGrew) as caught:
        windows(2.3, 40.0, 231.0)
    assert str(caught.value) == (
        "training loss grew from 2.3 to 231 (100x) by optimizer step 6 (epoch 1): "
        "lower optim.lr (now 0.1, a peak of 0.1 at this batch)"
    )


def test_a_run_at_chance_after_its_epochs_is_marked_diverged(tmp_path, caplog):
    caplog.set_level(logging.ERROR)
    # 3 epochs of 34 steps: long enough to be judged (CHANCE_STEPS); 16 images a step keep it short
    overrides = (
        "model=cnn",
        "optim.lr=0",
        "epochs=3",
        "data.train_size=544",
        "batch_size=16",
        "data.test_size=64",
    )
    metrics = Trainer(compose_config(*overrides), tmp_path / "run").fit()
    assert metrics["status"] == "diverged"
    assert (
        metrics["error"].startswith("test accuracy ")
        and " after 3 epochs is chance for 10 classes" in metrics["error"]
    )
    assert metrics["error"].endswith("the run did not learn; optim.lr is 0: set e.g. optim.lr=0.05")
    assert read_metrics(tmp_path / "run")["status"] == "diverged"
    assert [record.getMessage() for record in caplog.records] == [metrics["error"]]


def test_a_diverged_run_exits_non_zero(tmp_path):
    result = run_cli(
        "model=cnn",
        "data=synthetic",
        "optim.lr=0",
        "epochs=3",
        "data.train_size=544",
        "data.test_size=64",
        "batch_size=16",  # 3 epochs of 34 steps, long enough to be judged
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert "is chance for 10 classes: the run did not learn" in result.stderr


def test_a_run_that_learns_is_completed(tmp_path):
    overrides = ("epochs=4", "data.train_size=1024", "batch_size=32", "optim.lr=0.05", "data.test_size=64")
    metrics = Trainer(compose_config(*overrides), tmp_path / "run").fit()
    assert metrics["steps"] >= 100
    assert metrics["status"] == "completed" and "error" not in metrics
    assert metrics["test_acc"] > 0.5


def test_a_two_class_run_that_learned_is_not_called_stuck():
    from trainer.epoch_report import did_not_learn

    def verdict(accuracy: float, classes: int) -> str | None:
        progress = Progress(epoch=5, step=200, history=[{"test_acc": accuracy}])
        parts = SimpleNamespace(classes=list(range(classes)), lr_peak=0.1, non_finite_advice="lower optim.lr")
        return did_not_learn(progress, parts)

    assert verdict(0.72, 2) is None and verdict(0.55, 2) is not None
    assert verdict(0.16, 10) is None and verdict(0.12, 10) is not None


def test_a_first_window_at_zero_loss_measures_no_growth():
    windows(0.0, 5.0, 50.0)  # no ZeroDivisionError, no LossGrew against a zero
