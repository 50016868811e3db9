"""The peak learning rate follows the global batch: optim.lr is given for optim.lr_base_batch
images and scaled to batch_size x processes x grad_accum_steps."""

from __future__ import annotations

import math

import pytest
from conftest import compose_config, read_metrics

from trainer import Trainer
from trainer.config import LrScaling, OptimConfig, OptimizerName, to_train_config
from trainer.optim import peak_lr


@pytest.mark.parametrize(
    ("name", "scaling", "global_batch", "expected"),
    [
        (OptimizerName.sgd, LrScaling.auto, 128, 0.05),  # the default run is unchanged
        (OptimizerName.sgd, LrScaling.auto, 512, 0.2),  # linear: 4x the batch, 4x the lr
        (OptimizerName.sgd, LrScaling.linear, 32, 0.0125),
        (OptimizerName.sgd, LrScaling.sqrt, 512, 0.1),
        (OptimizerName.adamw, LrScaling.auto, 512, 0.1),  # sqrt: 4x the batch, 2x the lr
        (OptimizerName.adamw, LrScaling.linear, 512, 0.2),
        (OptimizerName.adamw, LrScaling.none, 4096, 0.05),
    ],
)
def test_peak_lr_arithmetic(name, scaling, global_batch, expected):
    cfg = OptimConfig(name=name, lr=0.05, lr_base_batch=128, lr_scaling=scaling)
    assert math.isclose(peak_lr(cfg, global_batch), expected)


def test_perf_fast_gets_four_times_the_default_lr_and_adamw_its_square_root_rule():
    fast = to_train_config(compose_config("perf=fast", small=False))
    assert fast.batch_size == 512 and math.isclose(peak_lr(fast.optim, 512), 0.4)
    adamw = to_train_config(compose_config("optim=adamw", small=False))
    assert math.isclose(peak_lr(adamw.optim, 512), 2 * adamw.optim.lr)


def test_the_optimizer_peaks_at_the_lr_scaled_to_batch_times_accumulation(tmp_path):
    trainer = Trainer(compose_config("grad_accum_steps=2", "optim.lr=0.1"), tmp_path / "run").build()
    assert math.isclose(trainer.lr_peak, 0.1 * 32 * 2 / 128)
    assert math.isclose(trainer.optimizer.param_groups[0]["max_lr"], trainer.lr_peak)


def test_metrics_record_the_peak_lr(finished_run):
    # the cnn's SGD lr: 0.02 per 128 images (model.sgd_lr)
    assert math.isclose(read_metrics(finished_run)["lr_peak"], 0.02 * 32 / 128)


def test_a_base_batch_below_one_names_the_fix():
    with pytest.raises(Exception, match=r"optim.lr_base_batch=128"):
        to_train_config(compose_config("optim.lr_base_batch=0"))
