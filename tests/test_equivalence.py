"""Math-neutral toggles give the same losses as the baseline (deterministic=true, CPU).

Exact (bit-identical): set_to_none (every parameter gets a gradient each step, so the
optimizer sees the same values), num_workers (augmentation is seeded per image, not per
process), and pin_memory / non_blocking / data.prefetch / step_graph, which cannot act on a CPU and
say so. channels_last is close, not exact: NHWC convolutions sum in another order, so losses
agree to float32 rounding (rtol 1e-4).
"""

from __future__ import annotations

import pytest
from conftest import compose_config
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainer import Trainer, tags

STEPS = 8
EQUIVALENCE = ["deterministic=true", "log_every=1", f"max_steps={STEPS}"]


def step_losses(run_dir) -> list[float]:
    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    return [event.value for event in events.Scalars(tags.TRAIN_LOSS)]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("baseline")
    Trainer(compose_config(*EQUIVALENCE), run_dir).fit()
    losses = step_losses(run_dir)
    assert len(losses) == STEPS
    return losses


@pytest.mark.parametrize(
    "toggle",
    [
        "set_to_none=true",
        "num_workers=2",
        "pin_memory=true",
        "non_blocking=true",
        "data.prefetch=true",
        "step_graph=true",
    ],
)
def test_exactly_equal_losses(tmp_path, baseline, toggle):
    Trainer(compose_config(*EQUIVALENCE, toggle), tmp_path).fit()
    assert step_losses(tmp_path) == baseline


def test_channels_last_losses_agree_to_rounding(tmp_path, baseline):
    Trainer(compose_config(*EQUIVALENCE, "channels_last=true"), tmp_path).fit()
    assert step_losses(tmp_path) == pytest.approx(baseline, rel=1e-4)
