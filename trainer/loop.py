"""The loop: epochs of optimizer steps over the assembled parts, with evaluation between them.

    epochs_run = train(parts, progress, run, evaluate, started=time.perf_counter())

Owns: the order of work. An epoch's micro-batches with gradient accumulation; the step
(forward and backward under autocast and the gradient average, or their CUDA graph's replay;
the scaled optimizer step, the scheduler, the weight average); one read of the losses per log
window, which is also where a NaN/inf loss stops the run; the epoch's record. (The warm-up
before the clock: trainer/warm_up.py.)
Change the loop here.
Must not touch: the config (every decision is already a field of `Parts`, trainer/assembly.py),
signals and files (the run lends its log, its profiler and its agreed stop: trainer/run.py),
process groups (trainer/distributed.py; an epoch's totals are summed over the ranks in it).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from trainer import distributed, evaluation, tags
from trainer.errors import Diverged
from trainer.logging import percent
from trainer.parts import Batch, Parts
from trainer.progress import Progress

if TYPE_CHECKING:
    from trainer.run import Run

log = logging.getLogger(__name__)


class NonFiniteLoss(Diverged):
    pass


class LossGrew(Diverged):
    pass


# A log window's mean loss this many times the first window's is a run that diverged, even
# while it stays finite (a cnn without BatchNorm at lr 0.1 on 2,000 images reached 3e8).
LOSS_GROWTH_LIMIT = 100


def accumulation_plan(micro_batches: int, accum_steps: int) -> list[tuple[int, bool]]:
    """(loss divisor, is the last micro-batch of its optimizer step) for each micro-batch.

    A trailing group shorter than accum_steps divides by its own size, so every optimizer
    step averages the loss over exactly the micro-batches it saw."""
    plan = []
    for index in range(micro_batches):
        group_start = index - index % accum_steps
        group_size = min(accum_steps, micro_batches - group_start)
        plan.append((group_size, index - group_start == group_size - 1))
    return plan


def train(parts: Parts, progress: Progress, run: Run, evaluate: Callable[[], dict], started: float) -> int:
    """Epochs until the last one, the step budget or a stop every rank agreed on; each finished
    epoch, evaluated when the plan says so, goes to the run as a record. Returns how many ran."""
    epochs_run = 0
    while progress.epoch < parts.epochs and progress.step < parts.total_steps and not run.stop_agreed():
        record = train_epoch(parts, progress, run)
        if run.stop_signal and progress.batch_in_epoch < parts.batches_per_epoch:  # inside the epoch
            break
        progress.epoch += 1
        progress.batch_in_epoch = 0
        last = progress.epoch == parts.epochs or progress.step >= parts.total_steps
        if parts.eval_plan.due(progress.epoch, last):
            evaluated = time.perf_counter()
            record.update(evaluate())  # its all-reduce's .tolist() waits for the device
            record["eval_s"] = time.perf_counter() - evaluated
            progress.eval_time_s += record["eval_s"]
        record["wall_s"] = time.perf_counter() - started
        progress.add_epoch(record)
        progress.note_target(record, parts.target_acc)
        run.epoch_done(record)
        epochs_run += 1
    return epochs_run


def train_epoch(parts: Parts, progress: Progress, run: Run) -> dict:
    """One epoch, or what a resume left of it; it ends early at the step budget or an agreed stop."""
    parts.model.train()
    skip = progress.batch_in_epoch
    parts.train_loader.set_epoch(progress.epoch, skip)
    plan = accumulation_plan(len(parts.train_batches), parts.grad_accum_steps)
    correct = torch.zeros((), device=parts.device, dtype=torch.long)
    window: list[torch.Tensor] = []
    loss_total, micro_batches = 0.0, 0
    bar = run.log.progress(len(plan), f"epoch {progress.epoch + 1}/{parts.epochs}")
    parts.synchronize()
    if parts.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(parts.device)
    started = window_started = time.perf_counter()
    for (images, labels), (divisor, boundary) in zip(parts.timer.wrap(parts.train_batches), plan):
        loss, hits = forward_backward(parts, images, labels, divisor, boundary)
        window.append(loss)
        correct += hits
        if boundary:
            optimizer_step(parts, progress)
        parts.timer.step_done()
        bar.update()
        run.profiler.step()
        if not boundary:
            continue
        if progress.step % parts.log_every == 0 or progress.step >= parts.total_steps:
            loss_total += log_window(parts, progress, run, window, bar, window_started)
            micro_batches += len(window)
            window, window_started = [], time.perf_counter()
        if progress.step >= parts.total_steps or run.stop_agreed():
            break
    if window:
        loss_total += log_window(parts, progress, run, window, bar, window_started)
        micro_batches += len(window)
    parts.sync_buffers()  # before the evaluation and checkpoint that follow an epoch or a stop
    parts.synchronize()
    epoch_s = time.perf_counter() - started
    bar.close()
    progress.train_time_s += epoch_s
    progress.batch_in_epoch = skip + micro_batches
    return epoch_record(parts, progress, loss_total, float(correct), micro_batches, epoch_s)


def forward_backward(parts: Parts, images: torch.Tensor, labels: torch.Tensor, divisor: int, boundary: bool):
    """One micro-batch's forward and backward; on the last of an optimizer step (`boundary`) the
    gradients averaged over the ranks too, where no DistributedDataParallel does it. Returns
    (loss, number of right predictions). Under step_graph the boundary's work is one replay."""
    if boundary and parts.step_graph is not None:
        body = functools.partial(backward_pass, parts, divisor=1, boundary=True)
        loss, correct = parts.step_graph(images, labels, body)
    else:
        loss, correct = backward_pass(parts, images, labels, divisor, boundary)
    # Under CUDA graphs the outputs live in the graph's memory, which its next replay overwrites:
    # the loss is read a log window later, so it is copied out; the count is added up at once.
    return loss.detach().clone(), correct


def backward_pass(parts: Parts, images: torch.Tensor, labels: torch.Tensor, divisor: int, boundary: bool):
    with contextlib.nullcontext() if boundary else parts.no_sync():
        with parts.autocast():
            loss, correct = parts.model(images, labels)
        parts.scaler.scale(loss / divisor).backward()
    if boundary:
        parts.average_gradients()
    return loss, correct


def apply_gradients(parts: Parts) -> None:
    """The averaged gradients into the weights."""
    parts.scaler.step(parts.optimizer)
    parts.scaler.update()
    parts.zero_grad()


def optimizer_step(parts: Parts, progress: Progress) -> None:
    apply_gradients(parts)
    parts.scheduler.step()
    progress.step += 1
    parts.average.after_step(progress.step)


def log_window(parts: Parts, progress: Progress, run: Run, window: list, bar, started: float) -> float:
    """One host sync per window: read the losses, stop on NaN/inf, log. Returns their sum. The
    window's rate is timed to that sync: before it, the host has only queued the window's work
    (with CUDA graphs the bar read 114k img/s on an epoch of 78k)."""
    losses = torch.stack(window).float().tolist()
    seconds = time.perf_counter() - started
    bad = next((i for i, value in enumerate(losses) if not math.isfinite(value)), None)
    if bad is not None:
        steps_in_window = math.ceil(len(losses) / parts.grad_accum_steps)
        step = progress.step - steps_in_window + bad // parts.grad_accum_steps + 1
        raise NonFiniteLoss(
            f"training loss became {losses[bad]} at optimizer step {step} (epoch {progress.epoch + 1}): "
            f"{parts.non_finite_advice}"
        )
    mean = sum(losses) / len(losses)
    if not progress.first_loss:  # None, or a first window at 0: nothing to measure growth by
        progress.first_loss = mean or None
    elif mean > LOSS_GROWTH_LIMIT * progress.first_loss:
        raise LossGrew(
            f"training loss grew from {progress.first_loss:.4g} to {mean:.4g} "
            f"({mean / progress.first_loss:,.0f}x) by optimizer step {progress.step} "
            f"(epoch {progress.epoch + 1}): {parts.non_finite_advice}"
        )
    images_per_s = len(losses) * parts.images_per_micro_batch / max(seconds, 1e-9)
    run.log.scalars(progress.step, {tags.TRAIN_LOSS: mean, tags.LR: parts.scheduler.get_last_lr()[0]})
    bar.set_postfix(
        loss=f"{mean:.3f}",
        img_s=f"{images_per_s:,.0f}",
        mfu=percent(parts.mfu.utilization(images_per_s, progress.epoch)),
        refresh=False,
    )
    return sum(losses)


def epoch_record(
    parts: Parts, progress: Progress, loss_total: float, correct: float, micro_batches: int, epoch_s: float
) -> dict:
    """The epoch's numbers: loss and accuracy over every rank's micro-batches, speed over this one's."""
    device = parts.device
    totals = distributed.all_reduce_sum(
        torch.tensor([loss_total, correct, micro_batches], dtype=torch.float64, device=device), parts.ranks
    ).tolist()
    wait = parts.timer.wait_seconds()
    images_per_s = micro_batches * parts.images_per_micro_batch / epoch_s
    return {
        "epoch": progress.epoch + 1,
        "step": progress.step,
        "train_loss": totals[0] / max(totals[2], 1),
        "train_acc": totals[1] / max(totals[2] * parts.batch_size, 1),
        "img_per_s": images_per_s,
        "mfu": parts.mfu.utilization(images_per_s, progress.epoch),
        "epoch_s": epoch_s,
        "data_wait_frac": None if wait is None else wait / epoch_s,
        "peak_mem_mb": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
        "train_time_s": progress.train_time_s,
    }


def evaluate(parts: Parts, batches: Iterable[Batch] | None = None) -> dict:
    """Test loss and accuracy over every test image exactly once (summed across ranks), of the
    weight average when ema is on; with eval.tta also test_acc_tta. With ema on, the trained
    weights are evaluated too, beside it: test_acc_trained (and the other keys, so suffixed).
    `batches`: these instead of the test set's (the warm-up's)."""
    common = (
        parts.test_batches if batches is None else batches,
        parts.tta_views,
        parts.device,
        parts.autocast,
        parts.ranks,
        parts.tta_unsure,
    )
    with parts.evaluation_backend():
        results = evaluation.evaluate(parts.average.module, *common)
        if parts.average.module is not parts.raw_model:
            trained = evaluation.evaluate(parts.raw_model, *common)
            results |= {f"{key}_trained": value for key, value in trained.items()}
    return results
