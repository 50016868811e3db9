"""Progress a person can see: a bar on a terminal, log lines every tenth of an epoch or 30 s
elsewhere, and the command line's console for a run started from Python."""

from __future__ import annotations

import logging

from conftest import compose_config

from trainer import Trainer
from trainer.console import console_unless_configured
from trainer.progress_bar import StepProgress


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def logged_counts(caplog) -> list[int]:
    return [
        int(r.getMessage().split(" | ")[1].split("/")[0])
        for r in caplog.records
        if r.name == "trainer.progress"
    ]


def test_a_redirected_log_hears_every_tenth_of_an_epoch_and_every_30_seconds(caplog):
    caplog.set_level(logging.INFO, logger="trainer.progress")
    clock = Clock()
    progress = StepProgress(1000, "epoch 1/1", terminal=False, clock=clock)
    for step in range(1, 251):
        clock.now += 31.0 if step == 205 else 0.01
        progress.update()
    assert logged_counts(caplog) == [100, 200, 205]
    progress.set_postfix(loss="2.301")
    for _ in range(50):
        progress.update()
    assert logged_counts(caplog)[-1] == 300 and caplog.records[-1].getMessage().endswith("| loss 2.301")


def test_on_a_terminal_the_bar_moves_every_batch_and_stays_when_the_epoch_ends():
    progress = StepProgress(40, "epoch 1/1", terminal=True)
    for _ in range(40):
        progress.update()
    assert progress.bar.n == 40 and progress.bar.leave
    progress.close()


def test_a_run_from_python_logs_like_the_command_line_unless_the_caller_set_up_logging(
    tmp_path, monkeypatch, capsys
):
    ours = logging.getLogger("trainer")
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # a plain script: nobody configured logging
    monkeypatch.setattr(ours, "handlers", [])
    monkeypatch.setattr(ours, "level", logging.NOTSET)
    Trainer(compose_config("max_steps=2"), tmp_path / "run").fit()
    shown = capsys.readouterr().out
    assert "run folder:" in shown and "epoch 1/1 | step 2" in shown
    monkeypatch.setattr(ours, "handlers", [])
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.NullHandler()])  # the caller's own
    console_unless_configured()
    assert ours.handlers == []


def test_the_bar_rate_counts_the_wait_for_the_device_to_finish_the_window(monkeypatch):
    """With CUDA graphs the host queues a window's steps far ahead of the device: the rate must be
    timed to the sync that reads the losses, not to the last step queued."""
    from types import SimpleNamespace

    import torch

    from trainer import loop

    clock, stack = Clock(), torch.stack

    def stack_after_the_device(tensors):  # reading the losses waits 1 s for the device
        clock.now += 1.0
        return stack(tensors)

    monkeypatch.setattr(loop.time, "perf_counter", clock)
    monkeypatch.setattr(loop.torch, "stack", stack_after_the_device)
    shown = {}
    parts = SimpleNamespace(
        grad_accum_steps=1,
        images_per_micro_batch=100,
        scheduler=SimpleNamespace(get_last_lr=lambda: [0.1]),
        mfu=SimpleNamespace(utilization=lambda *_: None),
    )
    run = SimpleNamespace(log=SimpleNamespace(scalars=lambda *_: None))
    bar = SimpleNamespace(set_postfix=lambda **values: shown.update(values))
    window = [torch.tensor(2.0)] * 4
    loop.log_window(
        parts, SimpleNamespace(step=4, epoch=0, first_loss=None), run, window, bar, started=clock.now
    )
    assert shown["img_s"] == "400" and shown["loss"] == "2.000"
