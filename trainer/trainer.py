"""Trainer: builds model, data and loop from a config, then fits.

    from trainer import Trainer
    metrics = Trainer(cfg).fit()          # cfg: a composed DictConfig, a dict or a TrainConfig

Every decision is taken in trainer/assembly.py (`build` calls it), whose `Parts` the step
functions below run with: they have no config branches.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import math
import sys
import time
from pathlib import Path

import torch

from trainer import checkpoint, distributed, evaluation, run_lock, timing
from trainer.assembly import Parts, assemble, resolve_device
from trainer.config import TrainConfig, TrainerError, to_train_config
from trainer.distributed import Ranks
from trainer.logging import configure_rank_logging, percent, read_metrics
from trainer.progress import Progress
from trainer.run import Run, default_run_dir, record_rejected_config

log = logging.getLogger(__name__)


class NonFiniteLoss(TrainerError):
    pass


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


class Trainer:
    def __init__(
        self,
        cfg,
        run_dir: str | Path | None = None,
        *,
        ranks: Ranks | None = None,
        overrides: list[str] | None = None,
    ):
        timing.start_run()
        self.cfg: TrainConfig = to_train_config(cfg)
        self.ranks = ranks
        self.progress = Progress()  # the loop advances it; the run saves and reports it
        self.parts: Parts | None = None  # build's
        run_dir = Path(run_dir) if run_dir is not None else default_run_dir()
        self.run = Run(self.cfg, run_dir, list(overrides or []), self.progress)
        self.config = self.run.config  # the resolved config, as checkpoints save it

    # ------------------------------------------------------------------ entry points

    @classmethod
    def for_run(cls, cfg, run_dir: str | Path, overrides: list[str]) -> Trainer:
        """A Trainer for a run folder that already exists (Hydra's); a config it rejects
        still leaves a metrics.json saying why."""
        try:
            return cls(cfg, run_dir, overrides=overrides)
        except TrainerError as error:
            record_rejected_config(Path(run_dir), error, overrides)
            raise

    def fit(self) -> dict:
        """Train, evaluate, checkpoint; return the final metrics (also in metrics.json)."""
        # The process that starts the run owns its folder; ranks it launched run inside that.
        with run_lock.owned(self.run.run_dir) if self.ranks is None else contextlib.nullcontext():
            return self._fit_or_record_failure()

    def _fit_or_record_failure(self) -> dict:
        try:
            if self.cfg.ddp and self.ranks is None and distributed.started_by_torchrun():
                self.ranks = distributed.torchrun_ranks()
                if not self.ranks.is_main:  # rank 0 keeps Hydra's console and log file
                    configure_rank_logging(self.ranks, self.run.run_dir)
            if self.cfg.ddp and self.ranks is None:
                return self._launch_workers()
            if self.cfg.ddp:
                return self._fit_in_process_group()
            return self._fit(self.ranks or Ranks())
        except BaseException as error:
            if self.ranks is None or self.ranks.is_main:
                self.run.record_failure(error, self.ranks)
            raise

    def _launch_workers(self) -> dict:
        device_type = resolve_device(self.cfg.device, Ranks(), ddp=True).type
        distributed.backend_for(self.cfg, device_type)  # refuse impossible backends before spawning
        world_size = distributed.world_size_for(self.cfg, device_type)
        log.info("ddp: launching %d processes (%s)", world_size, device_type)
        run_dir = self.run.run_dir
        arguments = (self.config, str(run_dir), self.run.overrides)
        launched = time.time()
        try:
            metrics = distributed.launch(
                world_size, _fit_rank, arguments, self.cfg.ddp_max_restarts, log_dir=run_dir
            )
        except distributed.LaunchStopped:
            metrics = read_metrics(run_dir)  # rank 0's, written as it stopped and saved
            if metrics.get("status") != "interrupted":
                raise
        except distributed.WorkerFailed:
            self.run.ranks_record = read_metrics(run_dir, since=launched)  # the failure record keeps it
            raise
        self.run.status = metrics["status"]
        return metrics

    def _fit_in_process_group(self) -> dict:
        """Inside the group the caller made, or in one made (and torn down) here."""
        if distributed.is_initialized():
            return self._fit(self.ranks)
        device = resolve_device(self.cfg.device, self.ranks, ddp=True)
        distributed.init_process_group(distributed.backend_for(self.cfg, device.type), self.ranks, device)
        try:
            return self._fit(self.ranks)
        finally:
            distributed.destroy_process_group()

    def _fit(self, ranks: Ranks) -> dict:
        if self.parts is None:
            self.build(ranks)
        with self.run.training():
            self.progress.compile_s += self._warm_up()
            self.run.finish(self._train(started=time.perf_counter()))
        return self.run.close()

    # ------------------------------------------------------------------ build: every decision

    def build(self, ranks: Ranks | None = None) -> Trainer:
        """Assemble device, data, model, optimizer and loop pieces (fit() calls this)."""
        self.ranks = ranks = ranks or self.ranks or Ranks()
        self.run.device = device = resolve_device(self.cfg.device, ranks, self.cfg.ddp)
        resume = self.run.load_resume()
        self.parts = assemble(self.cfg, ranks, device)
        self.run.begin(self.parts, resume)
        return self

    def __getattr__(self, name: str):
        """The assembled parts read as the Trainer's own (trainer.optimizer, trainer.raw_model)."""
        parts = self.__dict__.get("parts")
        if parts is None or name.startswith("__"):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}' (before build)")
        return getattr(parts, name)

    def __setattr__(self, name: str, value) -> None:
        """Setting a part replaces the one the loop runs with (a test slows the batches so)."""
        parts = self.__dict__.get("parts")
        if parts is not None and name not in self.__dict__ and hasattr(parts, name):
            setattr(parts, name, value)
        else:
            super().__setattr__(name, value)

    # ------------------------------------------------------------------ the loop

    def _train(self, started: float) -> int:
        cfg = self.cfg
        epochs_run = 0
        while (
            self.progress.epoch < cfg.epochs
            and self.progress.step < self.total_steps
            and not self.run.stop_agreed()
        ):
            record = self._train_epoch()
            if (
                self.run.stop_signal and self.progress.batch_in_epoch < self.batches_per_epoch
            ):  # inside the epoch
                break
            self.progress.epoch += 1
            self.progress.batch_in_epoch = 0
            last = self.progress.epoch == cfg.epochs or self.progress.step >= self.total_steps
            if self.eval_plan.due(self.progress.epoch, last):
                evaluated = time.perf_counter()
                record.update(self.evaluate())  # its all-reduce's .tolist() waits for the device
                record["eval_s"] = time.perf_counter() - evaluated
                self.progress.eval_time_s += record["eval_s"]
            record["wall_s"] = time.perf_counter() - started
            self.progress.add_epoch(record)
            self.progress.note_target(record, cfg.target_acc)
            self.run.epoch_done(record)
            epochs_run += 1
        return epochs_run

    def _train_epoch(self) -> dict:
        cfg, device = self.cfg, self.device
        self.model.train()
        skip = self.progress.batch_in_epoch
        self.train_loader.set_epoch(self.progress.epoch, skip)
        plan = accumulation_plan(len(self.train_batches), cfg.grad_accum_steps)
        correct = torch.zeros((), device=device, dtype=torch.long)
        window: list[torch.Tensor] = []
        loss_total, micro_batches = 0.0, 0
        progress = self.run.log.progress(len(plan), f"epoch {self.progress.epoch + 1}/{cfg.epochs}")
        self.synchronize()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        started = window_started = time.perf_counter()
        for (images, labels), (divisor, boundary) in zip(self.timer.wrap(self.train_batches), plan):
            with contextlib.nullcontext() if boundary else self.no_sync():
                loss, hits = self._forward_backward(images, labels, divisor)
            window.append(loss)
            correct += hits
            if boundary:
                self._optimizer_step()
            self.timer.step_done()
            self.run.profiler.step()
            if not boundary:
                continue
            if self.progress.step % cfg.log_every == 0 or self.progress.step >= self.total_steps:
                loss_total += self._log_window(window, progress, time.perf_counter() - window_started)
                micro_batches += len(window)
                window, window_started = [], time.perf_counter()
            if self.progress.step >= self.total_steps or self.run.stop_agreed():
                break
        if window:
            loss_total += self._log_window(window, progress, time.perf_counter() - window_started)
            micro_batches += len(window)
        self.synchronize()
        epoch_s = time.perf_counter() - started
        progress.close()
        self.progress.train_time_s += epoch_s
        self.progress.batch_in_epoch = skip + micro_batches
        totals = distributed.all_reduce_sum(
            torch.tensor([loss_total, float(correct), micro_batches], dtype=torch.float64, device=device),
            self.ranks,
        ).tolist()
        wait = self.timer.wait_seconds()
        images_per_s = micro_batches * self.images_per_micro_batch / epoch_s
        return {
            "epoch": self.progress.epoch + 1,
            "step": self.progress.step,
            "train_loss": totals[0] / max(totals[2], 1),
            "train_acc": totals[1] / max(totals[2] * cfg.batch_size, 1),
            "img_per_s": images_per_s,
            "mfu": self.mfu.utilization(images_per_s),
            "epoch_s": epoch_s,
            "data_wait_frac": None if wait is None else wait / epoch_s,
            "peak_mem_mb": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
            "train_time_s": self.progress.train_time_s,
        }

    def _warm_up(self) -> float:
        """Compile and autotune on the first training batches and one evaluation before the clock
        starts, then put back every state those steps changed; returns their seconds (compile_s)."""
        if not self.warm_up_steps:
            return 0.0
        started = time.perf_counter()
        parts = {"model": self.raw_model, "optimizer": self.optimizer}
        if self.scaler.is_enabled():
            parts["scaler"] = self.scaler
        saved = {name: copy.deepcopy(part.state_dict()) for name, part in parts.items()}
        self.model.train()
        self.train_loader.set_epoch(self.progress.epoch)
        for images, labels in itertools.islice(self.train_batches, self.warm_up_steps):
            self._forward_backward(images, labels, 1)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.zero_grad()
        for name, part in parts.items():
            part.load_state_dict(saved[name])
        self.evaluate()  # cuDNN's autotuning of the evaluation's shapes, outside time to target
        self.synchronize()
        seconds = time.perf_counter() - started
        log.info(
            "warm-up: %d steps compiled and autotuned in %.1f s (compile_s)", self.warm_up_steps, seconds
        )
        return seconds

    def _forward_backward(self, images: torch.Tensor, labels: torch.Tensor, divisor: int):
        with self.autocast():
            logits = self.model(images)
            loss = self.loss_fn(logits, labels)
        self.scaler.scale(loss / divisor).backward()
        return loss.detach(), (logits.detach().argmax(dim=1) == labels).sum()

    def _optimizer_step(self) -> None:
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.zero_grad()
        self.scheduler.step()
        self.progress.step += 1
        self.average.after_step(self.progress.step)

    def _log_window(self, window: list[torch.Tensor], progress, seconds: float) -> float:
        """One host sync per window: read the losses, stop on NaN/inf, log. Returns their sum."""
        losses = torch.stack(window).float().tolist()
        bad = next((i for i, value in enumerate(losses) if not math.isfinite(value)), None)
        if bad is not None:
            steps_in_window = math.ceil(len(losses) / self.cfg.grad_accum_steps)
            step = self.progress.step - steps_in_window + bad // self.cfg.grad_accum_steps + 1
            epoch = self.progress.epoch + 1
            raise NonFiniteLoss(
                f"training loss became {losses[bad]} at optimizer step {step} (epoch {epoch}): "
                f"{self.non_finite_advice}"
            )
        mean = sum(losses) / len(losses)
        images_per_s = len(losses) * self.images_per_micro_batch / max(seconds, 1e-9)
        self.run.log.scalars(self.progress.step, {"train/loss": mean, "lr": self.scheduler.get_last_lr()[0]})
        progress.set_postfix(
            loss=f"{mean:.3f}",
            img_s=f"{images_per_s:,.0f}",
            mfu=percent(self.mfu.utilization(images_per_s)),
            refresh=False,
        )
        progress.update(len(losses))
        return sum(losses)

    def evaluate(self) -> dict:
        """Test loss and accuracy over every test image exactly once (summed across ranks), of
        the weight average when ema is on; with eval.tta also test_acc_tta."""
        return evaluation.evaluate(
            self.average.module, self.test_batches, self.tta_views, self.device, self.autocast, self.ranks
        )


def _fit_rank(ranks: Ranks, config: dict, run_dir: str, overrides: list[str]) -> dict:
    """One launched DDP process: its own Trainer inside the process group. After a restart
    (ddp_max_restarts) the group continues from the run's own last checkpoint."""
    configure_rank_logging(ranks, Path(run_dir))
    saved = Path(run_dir) / checkpoint.CHECKPOINT
    if distributed.restart_count() > 0 and saved.is_file():
        log.warning("restart %d: resuming from %s", distributed.restart_count(), saved)
        config = {**config, "resume": run_dir}
    metrics = Trainer(config, run_dir, ranks=ranks, overrides=overrides).fit()
    if metrics["status"] == "interrupted":  # the agent that relayed the stop reads no results
        sys.exit(distributed.STOPPED_EXIT_CODE)
    return metrics
