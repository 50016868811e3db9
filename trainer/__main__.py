"""`python -m trainer [overrides]`: one run; `python -m trainer -m ...`: a sweep.

Owns: the command line: what it asks for (command_line.py) and its checks before Hydra makes
a folder (cli_checks.py), the run folder's lock, then Trainer.for_run(...).fit() in Hydra's
job; exit codes, one-line errors.
Must not touch: training (trainer/trainer.py and the modules it composes), the schema."""

from __future__ import annotations

import logging
import os
import sys

from trainer import heap
from trainer.serve import client

if __name__ == "__main__":
    # Before the imports below (Hydra, 0.2-0.5 s): a server of this environment takes the
    # command (trainer/serve); without one this returns at once.
    client.hand_over_command()
    heap.pause()  # through the imports below (trainer/heap.py)

from datetime import datetime
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig

from trainer import (
    bytecode,
    cuda_driver,
    parallel_jobs,
    pool_ahead,
    process_exit,
    run_lock,
    run_mode,
    sweep_checks,
    sweep_summary,
)
from trainer.cli_checks import CONF_DIR, check_command_line
from trainer.cli_help import register_help
from trainer.command_line import names_a_config, parallel_sweep_here, runs_here, split_command_line
from trainer.config import TrainerError, register_schema
from trainer.torchrun_env import started_by_torchrun

register_schema()
register_help()
log = logging.getLogger("trainer")


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def train(cfg: DictConfig) -> float | None:
    hydra_cfg = HydraConfig.get()
    sweep = hydra_cfg.mode == RunMode.MULTIRUN  # its folder from where the command ran (hydra.job.chdir)
    sweep_dir = os.path.join(hydra_cfg.runtime.cwd, hydra_cfg.sweep.dir) if sweep else None
    parallel = parallel_jobs.is_parallel(hydra_cfg.launcher.get("_target_"))
    n_jobs = hydra_cfg.launcher.n_jobs if parallel else None
    return run(cfg, hydra_cfg.runtime.output_dir, list(hydra_cfg.overrides.task), sweep_dir, n_jobs)


def run(
    cfg: DictConfig,
    run_dir: str,
    overrides: list[str],
    sweep_dir: str | None = None,
    parallel: int | None = None,
) -> float | None:
    """One job in its run folder: exit 1 with one error line when it fails, 130 when stopped.
    A job of a sweep (`sweep_dir`: the sweep's folder, which need not hold the job's) that fails
    raises, and the sweep goes on. A job of a parallel sweep (`parallel`: its n_jobs) returns
    instead, whatever happened: its metrics.json says it, and the sweep's last line reads them
    all (trainer/sweep_summary.py)."""
    sweep = sweep_dir is not None
    if parallel and sweep_summary.stop_requested(Path(sweep_dir)):
        return None  # the sweep was stopped before this job's turn
    if not parallel and cuda_driver.runs_here(cfg.device, cfg.ddp):
        cuda_driver.start_ahead()  # beside torch's imports (a parallel job's: once its GPU is set)
    # torch: only once the command line has passed its check
    with heap.imports():
        from trainer.perf.compile_workers import keep_compile_workers
        from trainer.perf.model import fresh_compile
        from trainer.trainer import Trainer

    note = bytecode.first_use_note()
    if note:
        log.info("%s", note)

    try:
        # the folder's lock: taken by main() already where the command line names the folder
        with parallel_jobs.job_resources(cfg, parallel) as (job_cfg, gpu), run_lock.owned(run_dir):
            if sweep:
                fresh_compile()  # after job_resources, which sets what CUDA sees before it starts
            if parallel or sweep_summary.launched_here():  # this process runs the sweep's next job too
                keep_compile_workers()
            metrics = Trainer.for_run(
                job_cfg, run_dir, overrides, jobs_at_once=parallel, device_name=gpu
            ).fit()
    except TrainerError as error:
        if parallel:
            log.error("%s", error)
            return None
        if sweep:
            raise  # the sweep goes on with the next job and reports this one at the end
        log.error("%s", error)
        sys.exit(1)
    if metrics["status"] == "interrupted" and not parallel:
        sys.exit(130)
    if metrics["status"] == "diverged" and not (parallel or sweep):
        sys.exit(1)  # the run's last line said why
    return metrics["test_acc"]


def torchrun_overrides() -> list[str]:
    """Under torchrun every rank runs this file: give them one shared run folder, and let only
    rank 0 write Hydra's files there."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    run_id = run_id if run_id != "none" else f"{os.getppid()}-{os.environ['MASTER_PORT']}"
    extra = [f"hydra.run.dir=outputs/{datetime.now():%Y-%m-%d}/torchrun-{run_id}"]
    if os.environ["RANK"] != "0":
        extra += ["hydra.output_subdir=null", "hydra/job_logging=disabled"]
    return extra


def named_run_folder(args: list[str]) -> str | None:
    """The folder a single run's command line names (hydra.run.dir=...), unless it interpolates:
    then only the job knows it, and takes the lock there."""
    _, hydra_overrides, multirun = split_command_line(args)
    named = [arg for arg in hydra_overrides if arg.startswith("hydra.run.dir=")]
    if multirun or not named:
        return None
    folder = str(OverridesParser.create().parse_override(named[-1]).value())
    return None if "${" in folder else folder


def main() -> None:
    args = sys.argv[1:]
    heap.freeze_and_resume()  # the command line's modules; its checks collect their own garbage
    try:
        if parallel_sweep_here(args):
            # first: the server's imports overlap the checks and the sweep's start; a command
            # the checks refuse ends it with this process (forkserver.stop)
            parallel_jobs.workers_from_forkserver()
        run_mode.forget()
        composed = check_command_line(args)
        overrides, hydra_overrides, multirun = split_command_line(args)
        single = not multirun and run_mode.mode_of(composed) is not RunMode.MULTIRUN
        if single and not names_a_config(args):  # the checks composed the config Hydra reads
            run_mode.remember([*overrides, *hydra_overrides], composed)  # Hydra's first question
            run_mode.install()
            if runs_here(args, hydra_overrides):  # not --cfg, --help
                cuda_driver.start_for_run(composed)  # beside Hydra's composition and the job's start
        if sweep_checks.jobs_checked:
            sweep_checks.install()  # Hydra's sweeper would compose every job once more
        if parallel_sweep_here(args):  # its workers start while Hydra composes the sweep again
            pool_ahead.start_workers(composed)
    except TrainerError as error:
        print(f"trainer: error: {error}", file=sys.stderr)
        sys.exit(2)
    if started_by_torchrun() and not any(arg.startswith("hydra.run.dir=") for arg in args):
        sys.argv += torchrun_overrides()
    # A folder a live run owns is refused before Hydra writes its config and log there.
    folder = named_run_folder(sys.argv[1:]) if run_lock.starts_runs() else None
    if folder:
        try:
            run_lock.acquire(folder)
        except TrainerError as error:
            print(f"trainer: error: {error}", file=sys.stderr)
            sys.exit(1)
    try:
        train()
    except SystemExit as stop:
        end_of_sweep(stop.code)
        raise
    finally:
        if folder:
            run_lock.release(folder)
    end_of_sweep(0)


def end_of_sweep(code: int | str | None) -> None:
    """After a sweep: its last line (which jobs failed or stopped) and, where the jobs returned
    (a parallel sweep's do), the exit code that line calls for."""
    outcome = sweep_summary.outcome()
    if outcome is None:
        return
    parallel_jobs.stop_workers()
    compile_workers = sys.modules.get("trainer.perf.compile_workers")  # imported where a job ran here
    if compile_workers is not None:
        compile_workers.end_sweep_pool()
    line, sweep_code = outcome
    print(line, file=sys.stderr if sweep_code else sys.stdout, flush=True)
    if sweep_code and not code:
        sys.exit(sweep_code)


def cli() -> None:
    """`python -m trainer` and the `trainer` command: handed to a server of this environment
    where one runs (trainer/serve), else main, then the process ends as soon as everything is
    written (trainer/process_exit.py). Before torch's import: its bytecode cached where its
    install has none (trainer/bytecode.py)."""
    client.hand_over_command()  # the `trainer` console script's way in: once, whichever came first
    heap.pause()
    bytecode.cache_bytecode()
    process_exit.run(main)


if __name__ == "__main__":
    cli()
