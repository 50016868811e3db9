"""profile=true: torch.profiler over a few steps, its trace written into the run folder.

Must not touch: which steps run (the loop calls step(), the run starts and stops it)."""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)


@dataclass
class Profiler:
    """torch.profiler over a few steps after warm-up; no-op when profile=false."""

    enabled: bool
    trace_dir: str
    warmup_steps: int = 5
    active_steps: int = 5

    def __post_init__(self) -> None:
        self.profiler = None
        if not self.enabled:
            return
        if not torch.cuda.is_available():
            # Writing the trace, kineto asks the CUDA driver for device properties even when only
            # CPU activity was recorded, and without a GPU prints "ERROR: ... gpuGetDeviceCount
            # failed" on stderr. Level 5 keeps its errors about GPUs out of a CPU run; it is read
            # when the profiler first starts in the process, and a value the user set stays.
            os.environ.setdefault("KINETO_LOG_LEVEL", "5")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                wait=0, warmup=self.warmup_steps, active=self.active_steps, repeat=1
            ),
            on_trace_ready=self._save,
        )
        self.profiler.start()

    def _save(self, profiler: torch.profiler.profile) -> None:
        # The handler's own worker name (<host>_<pid>), given so that the line below names this
        # process's trace and not another rank's in the same folder (the newest: a run resumed
        # into the same folder by this process adds another).
        worker = f"{socket.gethostname()}_{os.getpid()}"
        torch.profiler.tensorboard_trace_handler(self.trace_dir, worker_name=worker)(profiler)
        ours = Path(self.trace_dir).glob(f"{worker}.*.pt.trace.json")
        trace = max(ours, key=lambda path: path.stat().st_mtime)
        sort_by = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        log.info(
            "profile: top ops over %d steps; trace %s (open it in https://ui.perfetto.dev or "
            "chrome://tracing)\n%s",
            self.active_steps,
            trace,
            profiler.key_averages().table(sort_by=sort_by, row_limit=15),
        )

    def step(self) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def stop(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
