"""Learning-rate schedules: any total step count works with every schedule, and OneCycle keeps
its shape on runs of a few steps."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import compose_config

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
