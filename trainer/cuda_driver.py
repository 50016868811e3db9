"""CUDA's driver started in a thread while the run imports torch.

A run's first question to CUDA (`torch.cuda.is_available()`, where the run's device is
resolved) starts NVIDIA's driver, `cuInit`, and holds Python's lock while it does. That call
took 0.47 s on the main thread of each parallel sweep's worker on a 2-H200 host, after torch's
imports; loading libcuda and `cuInit` through ctypes in a worker, 0.05 s on another pair and
0.28-0.47 s on a pair of H100s (README, "Sweeps on every GPU"). Called through ctypes, which
lets go of that lock, and loaded through libc's dlopen, which then does too (`load`), it runs
beside the imports instead, and torch's own call then finds it done. By hand because torch has
no call that starts the driver without holding the lock, and importing torch first is what it
would overlap.

Only in a process that is about to run on CUDA itself, once what CUDA may see is settled
(CUDA_VISIBLE_DEVICES, read by cuInit: Hydra's job environment, a parallel job's GPU): a process
that forks runs after starting the driver hands them a driver they cannot use (the server, the
forkserver, a DDP launcher, the tuner never start it; a sweep's process that did forks no
server for a later DDP job: `started`).

Owns: when the driver is started ahead. Must not touch: torch (not imported here).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from pathlib import Path

from omegaconf import OmegaConf

_started = False


def loaded() -> bool:
    """Whether NVIDIA's driver is loaded on this host (its /proc entry), asked without CUDA."""
    return Path("/proc/driver/nvidia").exists()


def start_ahead() -> None:
    """cuInit in a daemon thread, once per process, where an NVIDIA driver is loaded."""
    global _started
    if _started or not loaded():
        return
    _started = True
    threading.Thread(target=initialize, name="cuda-driver", daemon=True).start()


def started() -> bool:
    """Whether this process started the driver ahead: a process forked from it could not use
    CUDA, though torch, which did not start it, does not know (trainer/forkserver.py asks)."""
    return _started


def initialize() -> None:
    with contextlib.suppress(OSError, AttributeError):  # no libcuda: torch says so in its own words
        load("libcuda.so.1").cuInit(0)


def load(name: str) -> ctypes.CDLL:
    """The shared library `name`, its loading done without Python's lock. ctypes.CDLL's own
    dlopen holds the lock while the loader works: the thread meant to start the driver beside
    the imports stopped them for as long (on the 2-core CPU a 500 MB library held the main
    thread 0.1 s). libc's dlopen called as a foreign function lets go of it, as ctypes does for
    every foreign call; ctypes.CDLL then finds the library loaded. The handle stays open, as
    ctypes leaves its own."""
    with contextlib.suppress(AttributeError):  # no dlopen among the process's symbols: ctypes's alone
        dlopen = ctypes.CDLL(None).dlopen
        dlopen.restype = ctypes.c_void_p
        dlopen.argtypes = (ctypes.c_char_p, ctypes.c_int)
        dlopen(name.encode(), os.RTLD_NOW | os.RTLD_LOCAL)  # a failure is ctypes.CDLL's to report
    return ctypes.CDLL(name)


def start_for_run(cfg) -> None:
    """A single run's driver started as soon as its command line has passed its checks (`cfg`:
    what they composed, with Hydra's node), before Hydra composes the config again, makes the
    run folder and starts the job: a tuner's forked trial, whose imports are done, otherwise
    started it there and then waited for it at its first CUDA call. Not where Hydra's job
    environment sets a CUDA_ or NVIDIA_ variable (hydra.job.env_set), which cuInit would read
    before the job had set it: that run starts its driver in the job (trainer.__main__.run)."""
    env_set = OmegaConf.select(cfg, "hydra.job.env_set", default=None) or {}
    if any(str(name).startswith(("CUDA_", "NVIDIA_")) for name in env_set):
        return
    if runs_here(str(cfg.device), bool(cfg.ddp)):
        start_ahead()


def runs_here(device: str, ddp: bool) -> bool:
    """Whether a run of these settings uses CUDA in this very process: device auto or cuda, and
    not ddp=true, whose ranks are processes of their own."""
    return not ddp and (device == "auto" or device.startswith("cuda"))
