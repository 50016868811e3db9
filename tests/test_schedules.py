"""Learning-rate schedules: any total step count works with every schedule, and OneCycle keeps
its shape on runs of a few steps."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_resumes_exactly, compose_config
from torch import nn

from trainer import Trainer
from trainer.config import OptimConfig, Schedule
from trainer.optim import build_scheduler

PEAK_LR = 0.05
WARMUP_FRACS = (0.05, 0.1, 0.2, 0.25, 0.3, 0.5, 0.9)


def learning_rates(schedule: Schedule, warmup_frac: float, total_steps: int) -> list[float]:
    """The learning rate of each of total_steps optimizer steps, as the Trainer steps it."""
    parameter = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.SGD([parameter], lr=PEAK_LR, momentum=0.9)
    scheduler = build_scheduler(
        OptimConfig(lr=PEAK_LR, schedule=schedule, warmup_frac=warmup_frac), optimizer, total_steps
    )
    rates = []
    for _ in range(total_steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("schedule", list(Schedule), ids=lambda schedule: schedule.value)
def test_every_total_step_count_works_with_every_schedule(schedule):
    for total_steps in range(1, 13):
        for warmup_frac in WARMUP_FRACS:
            rates = learning_rates(schedule, warmup_frac, total_steps)

            assert len(rates) == total_steps
            assert all(math.isfinite(rate) and 0 < rate <= PEAK_LR for rate in rates), rates


@pytest.mark.parametrize(("warmup_frac", "total_steps"), [(0.2, 5), (0.5, 2), (0.1, 10), (0.25, 4)], ids=str)
def test_a_one_step_warmup_starts_at_the_peak_and_anneals(warmup_frac, total_steps):
    """A warm-up of exactly one step (0.2 of 5 steps: the default on a 5-step run) divided
    by zero inside torch's OneCycleLR."""
    rates = learning_rates(Schedule.onecycle, warmup_frac, total_steps)

    assert rates[0] == pytest.approx(PEAK_LR)
    assert rates == sorted(rates, reverse=True)
    assert rates[-1] < PEAK_LR / 1000  # OneCycle ends at lr / 25 / 1e4


def test_longer_warmups_are_torchs_onecycle_unchanged():
    parameter = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.SGD([parameter], lr=PEAK_LR, momentum=0.9)
    reference = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=PEAK_LR, total_steps=12, pct_start=0.3)
    expected = []
    for _ in range(12):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        reference.step()

    assert learning_rates(Schedule.onecycle, 0.3, 12) == expected


def test_a_five_step_run_with_the_default_schedule_completes(tmp_path):
    """The issue's report: `max_steps=5` (default OneCycle, warm-up 0.2) crashed at build."""
    metrics = Trainer(compose_config("max_steps=5"), tmp_path / "run").fit()

    assert (metrics["status"], metrics["steps"]) == ("completed", 5)
    assert math.isfinite(metrics["train_loss"])


def test_the_linear_schedule_rises_from_its_start_fraction_and_falls_to_zero():
    rates = learning_rates(Schedule.linear, 0.25, 8)  # rises over 2 steps from 0.2 of the peak
    assert rates[:3] == pytest.approx([0.2 * PEAK_LR, 0.6 * PEAK_LR, PEAK_LR])
    assert rates[2:] == pytest.approx([PEAK_LR * (8 - step) / 6 for step in range(2, 8)])


def test_the_early_parameters_fall_to_zero_by_their_epoch_and_then_stay():
    """optim.early_epochs: fastcnn's whitening bias at the BatchNorm shifts' lr, falling to 0
    over the early steps; the other groups keep the run's schedule."""
    from trainer.fastcnn import fastcnn
    from trainer.optim import build_optimizer

    cfg = OptimConfig(lr=0.1, schedule=Schedule.linear, early_epochs=1, norm_bias_lr_scale=4)
    torch.manual_seed(0)
    model = fastcnn(10, widths=(8, 8, 8))
    optimizer = build_optimizer(cfg, model, {}, lr=0.1)
    scheduler = build_scheduler(cfg, optimizer, total_steps=6, steps_per_epoch=2)
    [early] = [group for group in optimizer.param_groups if group.get("early")]
    assert early["params"] == [model.whiten.bias] and early["lr"] == pytest.approx(0.4)
    rates, main_rates, biases, heads = [], [], [], []
    for _ in range(6):
        rates.append(early["lr"])
        main_rates.append(optimizer.param_groups[0]["lr"])
        loss = torch.nn.functional.cross_entropy(model(torch.randn(4, 3, 32, 32)), torch.arange(4))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        biases.append(model.whiten.bias.detach().clone())
        heads.append(model.head.weight.detach().clone())
    assert rates == pytest.approx([0.4, 0.2, 0, 0, 0, 0])
    assert not torch.equal(biases[0], biases[1])  # trained at the start
    assert all(torch.equal(biases[1], bias) for bias in biases[2:])  # still once its lr is 0
    assert not torch.equal(heads[4], heads[5]) and min(main_rates) > 0  # the rest still trains


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["model=cnn", "optim.schedule=linear"], "the model names no early parameters"),
        (["model=fastcnn", "optim.schedule=onecycle"], "which onecycle cannot: set optim.schedule=linear"),
        (
            ["model=fastcnn", "optim.schedule=linear", "epochs=1", "optim.early_epochs=2"],
            "is more than epochs=1",
        ),
    ],
)
def test_early_epochs_the_run_cannot_honour_are_refused_in_one_line(overrides, fragment):
    from trainer.config import ConfigError

    with pytest.raises(ConfigError) as caught:
        Trainer(compose_config("optim.early_epochs=1", *overrides)).fit()
    assert fragment in str(caught.value) and "\n" not in str(caught.value)


def early_net(num_classes: int) -> nn.Module:
    """A model of one's own that names its first conv's bias as early (model.target)."""

    class EarlyNet(nn.Sequential):
        def early_parameters(self) -> list[nn.Parameter]:
            return [self[0].bias]

    pooled = (nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, num_classes))
    return EarlyNet(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), *pooled)


def test_a_run_with_early_parameters_resumes_exactly(tmp_path):
    settings = ("model.target=test_schedules:early_net", "optim.schedule=linear", "optim.early_epochs=1")
    whole = assert_resumes_exactly((*settings, "deterministic=true", "epochs=2"), tmp_path)
    [early] = [group for group in whole.optimizer.param_groups if group.get("early")]
    assert early["params"] == [whole.raw_model[0].bias]
