"""The last line of a sweep: how many jobs completed, which failed or stopped, and the exit code.

    sweep: 3 of 4 jobs completed; failed: seed=2/2026-11-26_05-53-03.123456_2 (no class folders ...)
      | python -m trainer.report DIR    (all on one line; the interpreter's path where `python` is another)

Each job by its folder: from outputs/ beside the single runs (the default sweep folder), or
inside the sweep folder given as hydra.sweep.dir (`2_seed=2`; trainer/job_names.py).

A Hydra callback notes the sweep folder in the process that launches the jobs (on_multirun_start
runs there, whichever launcher); once the sweep is over, `outcome()` reads each job's
metrics.json, which every job writes whether it completed, failed or was stopped. Under
hydra/launcher=parallel the callback also takes SIGINT and SIGTERM in that process: no job starts
after them, and each running job is asked to stop at its next step and save, as a single run
is (its owner's pid is in the job's run.lock), so that the sweep ends with every finished job
and every stopped job's checkpoint kept.

Owns: the sweep's last line, its exit code, the parallel sweep's stop. Must not touch: the jobs
themselves (trainer/__main__.py runs each), the launchers (Hydra's).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import sys
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from trainer import parallel_jobs
from trainer.job_names import sweep_jobs
from trainer.report.jobs import NO_METRICS, UNREADABLE, read_metrics

STOP_FLAG = ".stop"  # in the sweep folder: jobs that have not started yet do not
EXIT_FAILED, EXIT_STOPPED = 1, 130

_sweep_dir: Path | None = None  # the sweep this process launched, once it has started


class SweepSummary(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        global _sweep_dir
        _sweep_dir = Path(str(config.hydra.sweep.dir))
        if parallel_jobs.is_parallel(config.hydra.launcher.get("_target_")):
            for signum in (signal.SIGINT, signal.SIGTERM):
                signal.signal(signum, stop_parallel_sweep)


def launched_here() -> bool:
    """Whether this process launched the sweep that runs its jobs (the basic launcher runs each in it)."""
    return _sweep_dir is not None


def stop_requested(sweep_dir: Path) -> bool:
    return (sweep_dir / STOP_FLAG).exists()


def stop_parallel_sweep(signum: int, _frame) -> None:
    """No more jobs start; the running ones stop at a step and save."""
    if _sweep_dir is None:
        return
    (_sweep_dir / STOP_FLAG).touch()
    for lock in (job / "run.lock" for job in sweep_jobs(_sweep_dir)):
        with contextlib.suppress(OSError, ValueError, json.JSONDecodeError):
            owner = json.loads(lock.read_text())
            if owner.get("host") in (None, socket.gethostname()):  # as run_lock names it
                os.kill(int(owner["pid"]), signal.SIGTERM)


def job_status(folder: Path) -> tuple[str, str]:
    """(completed | diverged | failed | interrupted | running | malformed metrics.json | not
    run, the error if any), as the report reads the job (trainer/report/jobs.py)."""
    metrics, status = read_metrics(folder)
    if status in (NO_METRICS, UNREADABLE):
        return "not run", ""
    return status, str(metrics.get("error") or "")


def job_label(folder: Path, sweep_dir: Path) -> str:
    """A job as its folder, from the sweep folder or, beside the single runs, from their
    folder: `2_seed=2`, or `seed=2/2026-11-26_05-53-03.123456_2`."""
    folder, sweep_dir = Path(os.path.abspath(folder)), Path(os.path.abspath(sweep_dir))
    if folder.parent == sweep_dir:
        return folder.name
    return folder.relative_to(sweep_dir.parents[2]).as_posix()


def outcome() -> tuple[str, int] | None:
    """(the sweep's last line, its exit code), or None where no sweep ran in this process."""
    if _sweep_dir is None or not _sweep_dir.is_dir():
        return None
    jobs = sweep_jobs(_sweep_dir)
    statuses = {job_label(folder, _sweep_dir): job_status(folder) for folder in jobs}
    completed = sum(status == "completed" for status, _ in statuses.values())
    stopped = [name for name, (status, _) in statuses.items() if status in ("interrupted", "not run")]
    failed = [  # "running" after the sweep: a job that died before it could say why
        f"{name} ({error.splitlines()[0][:120]})" if error else name
        for name, (status, error) in statuses.items()
        if status != "completed" and name not in stopped
    ]
    parts = [f"sweep: {completed} of {len(jobs)} jobs completed"]
    if failed:
        parts.append("failed: " + ", ".join(failed))
    if stopped:
        parts.append("stopped or not run: " + ", ".join(stopped))
    code = EXIT_FAILED if failed else EXIT_STOPPED if stopped else 0
    return "; ".join(parts) + f" | {python_command()} -m trainer.report {shlex.quote(str(_sweep_dir))}", code


def python_command() -> str:
    """This interpreter as a pasted hint should name it: `python` where a shell here runs this
    one (an activated venv, conda, the base interpreter), its path where `python` is another (a
    venv's interpreter run by its path, without activating it)."""
    on_path = shutil.which("python")
    here = os.path.abspath(sys.executable)
    with contextlib.suppress(OSError, TypeError):
        same_folder = os.path.dirname(os.path.abspath(on_path)) == os.path.dirname(here)
        if same_folder and os.path.samefile(on_path, here):
            return "python"
    return shlex.quote(here)
