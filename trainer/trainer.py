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
import signal
import sys
import time
from datetime import datetime
from pathlib import Path

import torch
from omegaconf import OmegaConf

from trainer import checkpoint, distributed, evaluation, mfu, perf, run_lock, timing
from trainer.assembly import Parts, assemble, resolve_device
from trainer.atomic import NotWritten
from trainer.config import ExportFormat, TrainConfig, TrainerError, to_train_config
from trainer.distributed import Ranks
from trainer.ema import WeightAverage
from trainer.export import export_model
from trainer.logging import RunLog, SilentRunLog, configure_rank_logging, read_metrics, write_json_atomic
from trainer.progress import Progress

log = logging.getLogger(__name__)


class NonFiniteLoss(TrainerError):
    pass


def default_run_dir() -> Path:
    now = datetime.now()
    return Path("outputs") / now.strftime("%Y-%m-%d") / now.strftime("%H-%M-%S.%f")


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
        self.config = OmegaConf.to_container(OmegaConf.structured(self.cfg), enum_to_str=True)
        self.run_dir = Path(run_dir) if run_dir is not None else default_run_dir()
        self.ranks = ranks
        self.overrides = list(overrides or [])
        self.status = "running"
        self.progress = Progress()
        self.stop_signal: str | None = None  # a stop every rank agreed on
        self.stop_requested: str | None = None  # the signal this process got
        self.stop_asked_at: int | None = None  # the step it came at
        self.device: torch.device | None = None  # resolved by build
        self.resumed_from: str | None = None
        self.exported: str | None = None  # the inference model's file, once written
        self.ranks_record: dict = {}  # a launcher's: rank 0's metrics.json when the ranks failed
        self.parts: Parts | None = None  # build's

    # ------------------------------------------------------------------ entry points

    @classmethod
    def for_run(cls, cfg, run_dir: str | Path, overrides: list[str]) -> Trainer:
        """A Trainer for a run folder that already exists (Hydra's); a config it rejects
        still leaves a metrics.json saying why."""
        try:
            return cls(cfg, run_dir, overrides=overrides)
        except TrainerError as error:
            with contextlib.suppress(NotWritten):  # a full disk: the error itself is what to report
                write_json_atomic(
                    Path(run_dir) / "metrics.json",
                    {"status": "failed", "error": str(error), "overrides": overrides},
                )
            raise

    def fit(self) -> dict:
        """Train, evaluate, checkpoint; return the final metrics (also in metrics.json)."""
        # The process that starts the run owns its folder; ranks it launched run inside that.
        with run_lock.owned(self.run_dir) if self.ranks is None else contextlib.nullcontext():
            return self._fit_or_record_failure()

    def _fit_or_record_failure(self) -> dict:
        try:
            if self.cfg.ddp and self.ranks is None and distributed.started_by_torchrun():
                self.ranks = distributed.torchrun_ranks()
                if not self.ranks.is_main:  # rank 0 keeps Hydra's console and log file
                    configure_rank_logging(self.ranks, self.run_dir)
            if self.cfg.ddp and self.ranks is None:
                return self._launch_workers()
            if self.cfg.ddp:
                return self._fit_in_process_group()
            return self._fit(self.ranks or Ranks())
        except BaseException as error:
            if self.ranks is None or self.ranks.is_main:
                self._record_failure(error)
            raise

    def _launch_workers(self) -> dict:
        device_type = resolve_device(self.cfg.device, Ranks(), ddp=True).type
        distributed.backend_for(self.cfg, device_type)  # refuse impossible backends before spawning
        world_size = distributed.world_size_for(self.cfg, device_type)
        log.info("ddp: launching %d processes (%s)", world_size, device_type)
        arguments = (self.config, str(self.run_dir), self.overrides)
        launched = time.time()
        try:
            metrics = distributed.launch(
                world_size, _fit_rank, arguments, self.cfg.ddp_max_restarts, log_dir=self.run_dir
            )
        except distributed.LaunchStopped:
            metrics = read_metrics(self.run_dir)  # rank 0's, written as it stopped and saved
            if metrics.get("status") != "interrupted":
                raise
        except distributed.WorkerFailed:
            self.ranks_record = read_metrics(self.run_dir, since=launched)  # the failure record keeps it
            raise
        self.status = metrics["status"]
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
        previous_handlers = self._catch_stop_signals()
        self.progress.compile_s += self._warm_up()
        self.fit_started = time.perf_counter()
        try:
            self._train()
        finally:
            for signum, handler in previous_handlers.items():
                signal.signal(signum, handler)
            self.profiler.stop()
        summary = self.summary()
        self.run_log.metrics(summary)
        self.run_log.hparams(self.config, summary)
        self.run_log.close()
        return summary

    # ------------------------------------------------------------------ build: every decision

    def build(self, ranks: Ranks | None = None) -> Trainer:
        """Assemble device, data, model, optimizer and loop pieces (fit() calls this)."""
        self.ranks = ranks = ranks or self.ranks or Ranks()
        self.device = device = resolve_device(self.cfg.device, ranks, self.cfg.ddp)
        resume = checkpoint.load_checkpoint(self.cfg.resume) if self.cfg.resume else None
        self.parts = assemble(self.cfg, ranks, device)
        self.stop_vote = distributed.StopVote(ranks)
        if resume is not None:
            self._restore(*resume)
        # Files appear only once everything above has worked.
        if ranks.is_main:
            checkpoint.remove_partial_writes(self.run_dir / checkpoint.CHECKPOINT)
        self.run_log = RunLog(self.run_dir) if ranks.is_main else SilentRunLog(self.run_dir)
        self.profiler = perf.Profiler(self.profile, str(self.run_dir / "profile"))
        log.info("run folder: %s | %s", self.run_dir, self.description)
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

    def _train(self) -> None:
        cfg = self.cfg
        epochs_run = 0
        while (
            self.progress.epoch < cfg.epochs
            and self.progress.step < self.total_steps
            and not self._stop_agreed()
        ):
            record = self._train_epoch()
            if self.stop_signal and self.progress.batch_in_epoch < self.batches_per_epoch:  # inside the epoch
                break
            self.progress.epoch += 1
            self.progress.batch_in_epoch = 0
            last = self.progress.epoch == cfg.epochs or self.progress.step >= self.total_steps
            if self.eval_plan.due(self.progress.epoch, last):
                evaluated = time.perf_counter()
                record.update(self.evaluate())  # its all-reduce's .tolist() waits for the device
                record["eval_s"] = time.perf_counter() - evaluated
                self.progress.eval_time_s += record["eval_s"]
            record["wall_s"] = time.perf_counter() - self.fit_started
            self.progress.add_epoch(record)
            self.progress.note_target(record, cfg.target_acc)
            self._report_epoch(record)
            self._save_checkpoint()
            self.run_log.metrics(self.summary())
            epochs_run += 1
        self.stop_vote.close()
        if self.stop_signal:
            self.status = "interrupted"
            self._save_checkpoint()
            log.warning(
                "stopped by %s at step %d%s; checkpoint saved. Continue with resume=%s",
                self.stop_signal,
                self.progress.step,
                "" if self.stop_asked_at is None else f" (asked at step {self.stop_asked_at})",
                self.run_dir,
            )
        else:
            self.status = "completed"
            if epochs_run == 0:  # resumed from a finished run: this run's folder still gets its checkpoint
                log.info("resume=%s had already finished: nothing left to train", cfg.resume)
                self._save_checkpoint()
            if cfg.export is not ExportFormat.none and self.ranks.is_main:
                exported = export_model(self.average.module, cfg.export, self.run_dir)
                self.exported = str(exported.relative_to(self.run_dir))  # like evaluation.json's

    def _report_epoch(self, record: dict) -> None:
        """TensorBoard scalars, one log line, and the input-pipeline hint when data is slow."""
        cfg = self.cfg
        self.run_log.scalars(
            self.progress.step,
            {
                "train/acc": record["train_acc"],
                "test/loss": record.get("test_loss"),
                "test/acc": record.get("test_acc"),
                "test/acc_tta": record.get("test_acc_tta"),
                "perf/img_per_s": record["img_per_s"],
                "perf/mfu": record["mfu"],
                "perf/epoch_s": record["epoch_s"],
                "perf/data_wait_frac": record["data_wait_frac"],
                "perf/peak_mem_mb": record["peak_mem_mb"],
            },
        )
        log.info(
            "epoch %d/%d | step %d | loss %.4f | train acc %.4f | test acc %s | %.0f img/s | mfu %s"
            " | data wait %s",
            self.progress.epoch,
            cfg.epochs,
            self.progress.step,
            record["train_loss"],
            record["train_acc"],
            _fmt(record.get("test_acc")),
            record["img_per_s"],
            _percent(record["mfu"]),
            _fmt(record["data_wait_frac"]),
        )
        if (record["data_wait_frac"] or 0.0) > 0.2:
            log.warning(
                "%.0f%% of the epoch waited for data: try more num_workers, pin_memory=true"
                " or data.loader=gpu",
                100 * record["data_wait_frac"],
            )

    def _train_epoch(self) -> dict:
        cfg, device = self.cfg, self.device
        self.model.train()
        skip = self.progress.batch_in_epoch
        self.train_loader.set_epoch(self.progress.epoch, skip)
        plan = accumulation_plan(len(self.train_batches), cfg.grad_accum_steps)
        correct = torch.zeros((), device=device, dtype=torch.long)
        window: list[torch.Tensor] = []
        loss_total, micro_batches = 0.0, 0
        progress = self.run_log.progress(len(plan), f"epoch {self.progress.epoch + 1}/{cfg.epochs}")
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
            self.profiler.step()
            if not boundary:
                continue
            if self.progress.step % cfg.log_every == 0 or self.progress.step >= self.total_steps:
                loss_total += self._log_window(window, progress, time.perf_counter() - window_started)
                micro_batches += len(window)
                window, window_started = [], time.perf_counter()
            if self.progress.step >= self.total_steps or self._stop_agreed():
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
        self.run_log.scalars(self.progress.step, {"train/loss": mean, "lr": self.scheduler.get_last_lr()[0]})
        progress.set_postfix(
            loss=f"{mean:.3f}",
            img_s=f"{images_per_s:,.0f}",
            mfu=_percent(self.mfu.utilization(images_per_s)),
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

    # ------------------------------------------------------------------ stop, checkpoint, resume

    def _catch_stop_signals(self) -> dict:
        def request_stop(signum, _frame):
            self.stop_requested = signal.Signals(signum).name
            self.stop_asked_at = self.progress.step

        previous = {}
        with contextlib.suppress(ValueError):  # signals can only be caught in the main thread
            for signum in (signal.SIGINT, signal.SIGTERM):
                previous[signum] = signal.signal(signum, request_stop)
        return previous

    def _stop_agreed(self) -> bool:
        """Every rank stops at the same step: a stop asked of any rank is shared (under DDP a
        step later, so that no step waits for the vote)."""
        if not self.stop_signal and self.stop_vote.poll(self.stop_requested is not None):
            self.stop_signal = self.stop_requested or "a stop on another rank"
        return self.stop_signal is not None

    def _stateful(self) -> dict:
        """Everything a checkpoint holds the state of, by name (the weight average when ema is on)."""
        stateful = {
            "model": self.raw_model,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "scaler": self.scaler,
            "progress": self.progress,
        }
        if isinstance(self.average, WeightAverage):
            stateful["ema"] = self.average
        return stateful

    def _save_checkpoint(self) -> None:
        if self.ranks.is_main:
            checkpoint.save(
                self.run_dir / checkpoint.CHECKPOINT,
                self._stateful(),
                config=self.config,
                total_steps=self.total_steps,
                epoch=self.progress.epoch,  # also in progress; here for a reader of the file
                step=self.progress.step,
                classes=self.classes,
            )

    def _restore(self, path: Path, state: dict) -> None:
        checkpoint.check_compatible(
            state, self.config, self.total_steps, self.raw_model.state_dict(), self.classes
        )
        checkpoint.restore(self.cfg.resume, state, self._stateful())
        self.resumed_from = str(path)
        log.info(
            "resumed from %s at epoch %d, step %d", self.resumed_from, self.progress.epoch, self.progress.step
        )

    # ------------------------------------------------------------------ results

    def summary(self) -> dict:
        progress = self.progress.summary()
        meter = self.parts.mfu if self.parts else mfu.Meter()  # nothing counted before assembly
        return {
            "status": self.status,
            **progress,
            "mfu": meter.utilization(progress["img_per_s"]),  # over the same epochs as img_per_s
            "flops_per_image": meter.flops_per_image,
            "device": str(self.device) if self.device else self.cfg.device,
            "world_size": self.ranks.world_size if self.ranks else None,
            "torch": torch.__version__,
            "overrides": self.overrides,
            "resumed_from": self.resumed_from,
            "lr_peak": self.parts.lr_peak if self.parts else None,
            "target_acc": self.cfg.target_acc,
            "export": self.exported,
            "wall_s": timing.wall_s(),
        }

    def _record_failure(self, error: BaseException) -> None:
        """A failed run leaves a complete metrics.json that says so (and no new checkpoint)."""
        if isinstance(error, KeyboardInterrupt):
            self.status = "interrupted"
        else:
            self.status = "failed"
        # A launcher's own summary is empty: rank 0's record holds the run's progress.
        summary = {**self.summary(), **self.ranks_record, "status": self.status}
        summary["error"] = str(error).splitlines()[0] if str(error) else type(error).__name__
        if isinstance(error, distributed.WorkerFailed):
            summary["failed_rank"] = error.rank
        with contextlib.suppress(NotWritten):  # a full disk: the last record stays, the error is raised
            write_json_atomic(self.run_dir / "metrics.json", summary)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


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
