"""Input-pipeline diagnosis: how much of an epoch the step waited for data.

On CPU the host clock around `next()` is honest: compute is synchronous. On CUDA the
host runs ahead of the GPU, so host time in `next()` says nothing about GPU idle time.
There two events per step, recorded on the compute stream without synchronizing, give
the GPU's idle gap between the end of one step's work and the moment the next batch
was ready; the gaps are read once, at the end of the epoch.

Owns: the data-wait timers and the run's wall clock (wall_s). Must not touch: the loop (it
wraps the batches it is given and is told when a step is done).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from typing import Any


class NoDataWaitTimer:
    """measure_data_wait=false: batches pass straight through."""

    def wrap(self, batches: Iterable) -> Iterable:
        return batches

    def step_done(self) -> None:
        pass

    def wait_seconds(self) -> float | None:
        return None


class HostDataWaitTimer:
    def __init__(self) -> None:
        self.waited = 0.0

    def wrap(self, batches: Iterable) -> Iterator:
        self.waited = 0.0
        iterator = iter(batches)
        while True:
            start = time.perf_counter()
            batch = next(iterator, None)
            self.waited += time.perf_counter() - start
            if batch is None:
                return
            yield batch

    def step_done(self) -> None:
        pass

    def wait_seconds(self) -> float:
        return self.waited


class CudaDataWaitTimer:
    def __init__(self) -> None:
        import torch

        self.event = lambda: torch.cuda.Event(enable_timing=True)
        self.gaps: list[tuple[Any, Any]] = []
        self.last_done = None

    def wrap(self, batches: Iterable) -> Iterator:
        self.gaps = []
        self.last_done = self.event()
        self.last_done.record()
        for batch in batches:
            ready = self.event()
            ready.record()
            self.gaps.append((self.last_done, ready))
            yield batch

    def step_done(self) -> None:
        self.last_done = self.event()
        self.last_done.record()

    def wait_seconds(self) -> float:
        """Call after the epoch's work is synchronized."""
        return sum(done.elapsed_time(ready) for done, ready in self.gaps) / 1000.0


def data_wait_timer(enabled: bool, device_type: str):
    if not enabled:
        return NoDataWaitTimer()
    return CudaDataWaitTimer() if device_type == "cuda" else HostDataWaitTimer()


IMPORTED = time.monotonic()
_command_started_at: float | None = None  # a served run's command's start (time.time())
_served_by: int | None = None  # and the server's pid (trainer/serve)
_runs_started = 0  # runs begun in this process: a sweep runs its jobs one after another
_run_started = IMPORTED


def start_run() -> None:
    global _runs_started, _run_started
    _runs_started += 1
    _run_started = time.monotonic()


def runs_started() -> int:
    """Runs begun in this process so far. A forked process starts with its parent's count: the
    servers runs are forked from (trainer/serve, trainer/forkserver.py) begin none."""
    return _runs_started


def wall_s() -> float:
    """This run's seconds so far: for the process's first run since the process started (the
    interpreter and the imports included), for a sweep's later jobs since the job began."""
    return process_age_s() if _runs_started <= 1 else time.monotonic() - _run_started


def count_from(started_at: float, served_by: int) -> None:
    """A served run (trainer/serve/child.py): its age counts from its command's start
    (`started_at`, time.time()), before the fork from server `served_by`."""
    global _command_started_at, _served_by
    _command_started_at, _served_by = started_at, served_by


def _forget_command() -> None:
    """In a process forked from a served one (a parallel sweep's worker): its own age again."""
    global _command_started_at
    _command_started_at = None


os.register_at_fork(after_in_child=_forget_command)


def served_by() -> int | None:
    """The pid of the server this process was forked from for its command, or None."""
    return _served_by


def process_age_s() -> float:
    """Seconds since this process started (Linux: from /proc; elsewhere since this import);
    for a served run, since its command started."""
    if _command_started_at is not None:
        return time.time() - _command_started_at
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            started_ticks = int(stat.read().rpartition(")")[2].split()[19])  # field 22: starttime
            return float(uptime.read().split()[0]) - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.monotonic() - IMPORTED
