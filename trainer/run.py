"""The run's life: what it leaves in its folder and when, from the first file to the failure record.

    run = Run(cfg, run_dir, overrides, progress)
    run.begin(parts, run.load_resume())    # restore, then the folder's files
    with run.training():                   # SIGINT/SIGTERM: stop at a step and save
        run.finish(loop.train(parts, progress, run, evaluate, started))
    summary = run.close()                  # metrics.json, TensorBoard HParams

Owns: the checkpoint (saved after each epoch, written while the next trains, and at a stop;
restored on resume), metrics.json (after each epoch, at the end, and as the failure record of
a run that fails), the TensorBoard events, the profiler's trace, the exported model; each
epoch's report (a log line, scalars, the slow-input hint); SIGINT/SIGTERM as requests to stop
at a step every rank agrees on; the summary, and in a process that launched ranks, rank 0's.
The folder's name is default_run_dir's when none is given; the Trainer holds its lock
(trainer/run_lock.py) around all of the above.
Must not touch: how the parts are built (trainer/assembly.py), the order of work in an epoch
or a step (trainer/loop.py), process groups (trainer/distributed.py).
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import torch
from omegaconf import OmegaConf

from trainer import checkpoint, distributed, epoch_report, mfu, perf, timing
from trainer.atomic import remove_leftovers
from trainer.config import ExportFormat, TrainConfig
from trainer.console import console_unless_configured
from trainer.distributed import Ranks
from trainer.ema import WeightAverage
from trainer.errors import Diverged
from trainer.export import export_model
from trainer.logging import (
    RunLog,
    SilentRunLog,
    metrics_version,
    path_in,
    read_metrics,
    shell_override,
    shown_hparams,
    write_final_metrics,
)
from trainer.parts import Parts
from trainer.progress import Progress

log = logging.getLogger(__name__)


def default_run_dir() -> Path:
    now = datetime.now()
    return Path("outputs") / now.strftime("%Y-%m-%d") / now.strftime("%H-%M-%S.%f")


class Run:
    def __init__(
        self, cfg: TrainConfig, run_dir: str | Path | None, overrides: list[str] | None, progress: Progress
    ):
        console_unless_configured()  # a run from Python shows what the command line shows
        self.cfg = cfg
        self.config = OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)  # as saved
        self.run_dir = Path(run_dir) if run_dir is not None else default_run_dir()
        self.overrides = list(overrides or [])
        self.progress = progress  # the loop advances it; checkpoints and summaries read it
        self.status = "running"
        self.error: str | None = None  # why a run that ended its epochs is marked diverged
        self.device: torch.device | None = None  # once resolved
        self.device_name: str | None = None  # where the process numbers its GPUs unlike its host
        self.parts: Parts | None = None  # once assembled
        self.resumed_from: str | None = None
        self.exported: str | None = None  # the inference model's file, once written
        self.startup_s: float | None = None  # the process (or sweep job) before this run's set-up
        self.setup_s: float | None = None  # the assembly (data, model, optimizer) and the restore
        self.setup_data_s: float | None = None  # of setup_s, the data's part
        self.jobs_at_once: int | None = None  # hydra/launcher=parallel's n_jobs, for its sweep's jobs
        self.ranks_record: dict = {}  # a launcher's: rank 0's metrics.json when the ranks failed
        self.stop_signal: str | None = None  # a stop every rank agreed on
        self.stop_requested: str | None = None  # the signal this process got
        self.stop_asked_at: int | None = None  # the step it came at
        self.saver = checkpoint.Saver()  # writes each checkpoint beside the training

    def load_resume(self) -> tuple[Path, dict] | None:
        return checkpoint.load_checkpoint(self.cfg.resume) if self.cfg.resume else None

    def begin(self, parts: Parts, resume: tuple[Path, dict] | None) -> None:
        self.parts = parts
        self.stop_vote = distributed.StopVote(parts.ranks)
        if resume is not None:
            self.restore(*resume)
        # Files appear only once everything above has worked.
        if parts.ranks.is_main:
            remove_leftovers(self.run_dir / checkpoint.CHECKPOINT)  # a save killed midway
        self.log = (
            RunLog(self.run_dir, parts.tb_x_per_step) if parts.ranks.is_main else SilentRunLog(self.run_dir)
        )
        self.profiler = perf.Profiler(parts.profile, str(self.run_dir / "profile"))
        device = self.device_name or self.device
        log.info(
            "run folder: %s | device: %s x%d | %s",
            self.run_dir,
            device,
            parts.ranks.world_size,
            parts.description,
        )

    def launched_ranks(self, launch: Callable[[], dict]) -> dict:
        """What launch() returns: rank 0's metrics, also when the ranks stopped as asked; when a
        rank failed, rank 0's record is kept for this process's failure record."""
        before = metrics_version(self.run_dir)  # a record from before the launch is not the ranks'
        try:
            metrics = launch()
        except distributed.LaunchStopped:
            # Rank 0's record, written as it stopped and saved; or as it finished, when the stop
            # came after the last step (the ranks agree on a stop only between steps): the
            # completed run stands, and its record is not overwritten by a failure.
            metrics = read_metrics(self.run_dir, unless=before)
            if metrics.get("status") not in ("interrupted", "completed"):
                raise
        except distributed.WorkerFailed:
            self.ranks_record = read_metrics(self.run_dir, unless=before)
            raise
        self.status = metrics["status"]
        return metrics

    # ------------------------------------------------------------------ stops

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """While the loop runs, SIGINT and SIGTERM ask it to stop at a step (and save); after
        it, the profiler stops and the previous handlers are back."""

        def request_stop(signum, _frame):
            self.stop_requested = signal.Signals(signum).name
            self.stop_asked_at = self.progress.step

        previous = {}
        with contextlib.suppress(ValueError):  # signals can only be caught in the main thread
            for signum in (signal.SIGINT, signal.SIGTERM):
                previous[signum] = signal.signal(signum, request_stop)
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self.profiler.stop()

    def stop_agreed(self) -> bool:
        """Every rank stops at the same step: a stop asked of any rank is shared (under DDP a
        step later, so that no step waits for the vote)."""
        if not self.stop_signal and self.stop_vote.poll(self.stop_requested is not None):
            self.stop_signal = self.stop_requested or "a stop on another rank"
        return self.stop_signal is not None

    # ------------------------------------------------------------------ each epoch, the end

    def epoch_done(self, record: dict) -> None:
        self.saver.wait()  # the last epoch's checkpoint on disk (or its error) before this epoch's records
        epoch_report.report_epoch(self.log, self.progress, self.parts, record)
        self.log.metrics(self.summary(self.parts.ranks))
        self.save_checkpoint()  # written while the next epoch trains

    def finish(self, epochs_run: int) -> None:
        """After the loop: interrupted (saved where it stopped) or completed (exported as asked)."""
        self.stop_vote.close()
        if self.stop_signal:
            self.status = "interrupted"
            self.save_checkpoint()
            self.saver.wait()  # on disk before the line that says to resume from it
            log.warning(
                "stopped by %s at step %d%s; checkpoint saved. Continue with %s",
                self.stop_signal,
                self.progress.step,
                "" if self.stop_asked_at is None else f" (asked at step {self.stop_asked_at})",
                shell_override("resume", self.run_dir),
            )
            return
        self.status = "completed"
        verdict = epoch_report.did_not_learn(self.progress, self.parts)
        if verdict is not None:
            self.status, self.error = "diverged", verdict
            log.error("%s", verdict)
        if epochs_run == 0:  # resumed from a finished run: this run's folder still gets its checkpoint
            log.info("resume=%s had already finished: nothing left to train", self.cfg.resume)
            self.save_checkpoint()
        if self.cfg.export is not ExportFormat.none and self.parts.ranks.is_main:
            self.saver.wait()  # the checkpoint on disk before the exported weights
            exported = export_model(self.parts.average.module, self.cfg.export, self.run_dir)
            self.exported = path_in(self.run_dir, exported)

    def close(self) -> dict:
        self.saver.wait()
        summary = self.summary(self.parts.ranks)
        self.log.metrics(summary)
        self.log.hparams(shown_hparams(self.config, self.overrides))
        self.log.close()
        return summary

    # ------------------------------------------------------------------ checkpoint

    def stateful(self) -> dict:
        """Everything a checkpoint holds the state of, by name (the weight average when ema is on)."""
        parts = self.parts
        stateful = {
            "model": parts.raw_model,
            "optimizer": parts.optimizer,
            "scheduler": parts.scheduler,
            "scaler": parts.scaler,
            "progress": self.progress,
        }
        if isinstance(parts.average, WeightAverage):
            stateful["ema"] = parts.average
        return stateful

    def save_checkpoint(self) -> None:
        if self.parts.ranks.is_main:
            self.saver.save(
                self.run_dir / checkpoint.CHECKPOINT,
                self.stateful(),
                config=self.config,
                total_steps=self.parts.total_steps,
                epoch=self.progress.epoch,  # also in progress; here for a reader of the file
                step=self.progress.step,
                classes=self.parts.classes,
            )

    def restore(self, path: Path, state: dict) -> None:
        parts = self.parts
        checkpoint.check_compatible(
            state, self.config, parts.total_steps, parts.raw_model.state_dict(), parts.classes
        )
        checkpoint.restore(self.cfg.resume, state, self.stateful())
        self.resumed_from = path_in(self.run_dir, path)
        log.info("resumed from %s at epoch %d, step %d", path, self.progress.epoch, self.progress.step)

    # ------------------------------------------------------------------ results

    def summary(self, ranks: Ranks | None) -> dict:
        progress = self.progress.summary()
        meter = self.parts.mfu if self.parts else mfu.Meter()  # nothing counted before assembly
        return {
            "status": self.status,
            **({"error": self.error} if self.error else {}),
            **progress,
            "flops_per_image": meter.flops_per_image,
            "device": self.device_name or (str(self.device) if self.device else self.cfg.device),
            "world_size": ranks.world_size if ranks else None,
            "torch": torch.__version__,
            "overrides": self.overrides,
            "resumed_from": self.resumed_from,
            "lr_peak": self.parts.lr_peak if self.parts else None,
            "target_acc": self.cfg.target_acc,
            "export": self.exported,
            "served": timing.served_by() is not None,  # forked from python -m trainer.serve
            "startup_s": self.startup_s,
            "setup_s": self.setup_s,
            "setup_data_s": self.setup_data_s,
            "jobs_at_once": self.jobs_at_once,
            "wall_s": timing.wall_s(),
        }

    def record_failure(self, error: BaseException, ranks: Ranks | None) -> None:
        """A failed run leaves a complete metrics.json that says so (and no new checkpoint)."""
        self.saver.wait_logging_refusal()  # a checkpoint already on its way is kept
        self.status = "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"
        if isinstance(error, Diverged):
            self.status = "diverged"
        # A launcher's own summary is empty: rank 0's record holds the run's progress.
        if self.ranks_record.get("status") == "diverged":  # a rank's loss ran away: what rank 0 recorded
            self.status = "diverged"
        summary = {**self.summary(ranks), **self.ranks_record, "status": self.status}
        if self.progress.history and not self.ranks_record:
            # steps as last.pt holds them (the last epoch's), not the steps of the epoch cut short
            summary["steps"] = self.progress.history[-1]["step"]
        summary["error"] = str(error).splitlines()[0] if str(error) else type(error).__name__
        if isinstance(error, distributed.WorkerFailed):
            summary["failed_rank"] = error.rank
        write_final_metrics(self.run_dir, summary)
        if getattr(self, "log", None) is not None:
            with contextlib.suppress(Exception):  # TensorBoard's queue written out, as on success
                self.log.close()
