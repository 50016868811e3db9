"""Trainer: the public entry point, a short composition of the assembly, the run and the loop.

    from trainer import Trainer
    metrics = Trainer(cfg).fit()          # cfg: a composed DictConfig, a dict or a TrainConfig

Which file to open for a change:
    trainer/assembly.py     a new component: config -> Parts (model, loaders, optimizer, ...)
    trainer/loop.py         the epoch, the step, evaluation between epochs
    trainer/warm_up.py      the steps and the evaluation before the clock (compile_s)
    trainer/run.py          the run folder: checkpoints, metrics.json, signals, the summary
    trainer/perf/           a new optimization toggle
    trainer/distributed.py  launching DDP ranks, the process group
Owns: which of them runs in which process (launch ranks, join torchrun's group, or train
here) and the order: assemble, restore, warm up, train, finish, summarize.
Must not touch: any decision (assembly), any step of the loop (loop), any file of the run (run).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from pathlib import Path

import torch

from trainer import checkpoint, distributed, loop, perf, run_lock, timing
from trainer.assembly import assemble, resolve_device
from trainer.config import TrainConfig, TrainerError, to_train_config
from trainer.console import configure_rank_logging
from trainer.distributed import Ranks
from trainer.logging import record_rejected_config
from trainer.loop import NonFiniteLoss, accumulation_plan  # noqa: F401 - importable from here, as before
from trainer.parts import Parts
from trainer.progress import Progress
from trainer.run import Run
from trainer.warm_up import warm_up

log = logging.getLogger(__name__)


class Trainer:
    def __init__(
        self,
        cfg,
        run_dir: str | Path | None = None,
        *,
        ranks: Ranks | None = None,
        overrides: list[str] | None = None,
        jobs_at_once: int | None = None,
        device_name: str | None = None,
    ):
        timing.start_run()
        self.cfg: TrainConfig = to_train_config(cfg)
        self.ranks = ranks
        self.progress = Progress()  # the loop advances it; the run saves and reports it
        self.parts: Parts | None = None  # build's
        self.run = Run(self.cfg, run_dir, overrides, self.progress)
        self.run.jobs_at_once = jobs_at_once  # a parallel sweep's job: how many of its jobs run at once
        self.run.device_name = device_name  # and its GPU as the host numbers it (trainer.parallel_jobs)
        self.run.startup_s = timing.wall_s()  # the interpreter, imports, Hydra, the checks
        if (server := timing.served_by()) is not None:
            log.info("served: forked from python -m trainer.serve (pid %d), without its imports", server)
        self.config = self.run.config  # the resolved config, as checkpoints save it

    @classmethod
    def for_run(
        cls,
        cfg,
        run_dir: str | Path,
        overrides: list[str],
        jobs_at_once: int | None = None,
        device_name: str | None = None,
    ) -> Trainer:
        """A Trainer for a run folder that already exists (Hydra's); a config it rejects
        still leaves a metrics.json saying why."""
        try:
            return cls(cfg, run_dir, overrides=overrides, jobs_at_once=jobs_at_once, device_name=device_name)
        except TrainerError as error:
            record_rejected_config(Path(run_dir), error, overrides)
            raise

    def fit(self) -> dict:
        """Train, evaluate, checkpoint; return the final metrics (also in metrics.json)."""
        # The process that starts the run owns its folder; ranks it launched run inside that.
        with run_lock.owned(self.run.run_dir) if self.ranks is None else contextlib.nullcontext():
            try:
                return self._fit_here_or_in_ranks()
            except BaseException as error:
                if self.ranks is None or self.ranks.is_main:
                    self.run.record_failure(error, self.ranks)
                raise

    def build(self, ranks: Ranks | None = None) -> Trainer:
        """Assemble the parts and restore a resumed run's state into them (fit() calls this)."""
        started = time.perf_counter()
        self.ranks = ranks = ranks or self.ranks or Ranks()
        self.run.device = device = resolve_device(self.cfg.device, ranks, self.cfg.ddp)
        if device.type == "cuda":
            perf.make_current(device)
        resume = self.run.load_resume()
        self.parts = assemble(self.cfg, ranks, device)
        self.run.begin(self.parts, resume)
        if resume is None:  # a resumed run keeps the first attempt's, with its other times
            self.progress.init_s = self.parts.init_s
        self.run.setup_s = time.perf_counter() - started  # data, model, optimizer, the restore
        self.run.setup_data_s = self.parts.setup_data_s
        log.info("set-up %.2f s, of it the data's %.2f s", self.run.setup_s, self.run.setup_data_s)
        return self

    def evaluate(self) -> dict:
        """Test loss and accuracy of the evaluated model (the loop calls this: a subclass may wrap
        it; the warm-up's evaluation, of two batches, calls loop.evaluate itself)."""
        return loop.evaluate(self.parts)

    def _forward_backward(
        self, images: torch.Tensor, labels: torch.Tensor, divisor: int, boundary: bool = True
    ):
        return loop.forward_backward(self.parts, images, labels, divisor, boundary)

    def __getattr__(self, name: str):
        """The assembled parts read as the Trainer's own (trainer.optimizer, trainer.raw_model)."""
        if self.__dict__.get("parts") is None:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}' (before build)")
        return getattr(self.parts, name)

    def __setattr__(self, name: str, value) -> None:
        """Setting a part replaces the one the loop runs with (a test slows the batches so)."""
        parts = self.__dict__.get("parts")
        if parts is not None and name not in self.__dict__ and hasattr(parts, name):
            setattr(parts, name, value)
        else:
            super().__setattr__(name, value)

    def _fit_here_or_in_ranks(self) -> dict:
        if self.cfg.ddp and self.ranks is None and distributed.started_by_torchrun():
            self.ranks = distributed.torchrun_ranks()
            if not self.ranks.is_main:  # rank 0 keeps Hydra's console and log file
                configure_rank_logging(self.ranks, self.run.run_dir)
        if not self.cfg.ddp:
            return self._fit(self.ranks or Ranks())
        if self.ranks is None:
            return self._launch_ranks()
        device = resolve_device(self.cfg.device, self.ranks, ddp=True)
        with distributed.process_group(self.cfg, self.ranks, device):
            return self._fit(self.ranks)

    def _fit(self, ranks: Ranks) -> dict:
        if self.parts is None:
            self.build(ranks)
        stopping = None
        try:
            with self.run.training():
                self.progress.compile_s += warm_up(self.parts, self.progress.epoch)
                stopping = perf.stop_compile_workers()
                started = time.perf_counter()
                self.run.finish(loop.train(self.parts, self.progress, self.run, self.evaluate, started))
        finally:
            self.parts.autotuned()  # a run that failed in its warm-up leaves no thread timing cuDNN
            if self.parts.step_graph is not None:
                self.parts.step_graph.release()
            if stopping is not None:  # done long since; the next job in this process may start a pool
                join_started = time.perf_counter()
                stopping.join()
                if (waited := time.perf_counter() - join_started) > 0.5:  # metrics.json waited as long
                    log.info("waited %.1f s for inductor's compile workers to stop", waited)
        return self.run.close()

    def _launch_ranks(self) -> dict:
        """ddp=true from one process: the ranks run in processes of their own, this one waits."""
        device_type = resolve_device(self.cfg.device, Ranks(), ddp=True).type
        arguments, run_dir = (self.config, str(self.run.run_dir), self.run.overrides), self.run.run_dir
        return self.run.launched_ranks(
            lambda: distributed.launch_ranks(self.cfg, device_type, _fit_rank, arguments, log_dir=run_dir)
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
