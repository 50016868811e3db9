"""A parallel sweep's workers started while the sweep's process is still starting, each with a
GPU of its own and CUDA started on it.

A worker's first job started CUDA's driver and context only once the job held its GPU: on 2
H200s the context's start (with cuDNN's and cuBLAS's libraries) took 0.92 s of a first job's
set-up, the driver's 0.05 s (a traced served sweep, README, "Sweeps on every GPU"). Where the
sweep's forkserver starts with the trainer imported already (a command served by
`python -m trainer.serve`: trainer/forkserver.py, `starts_at_once`), the pool's workers start
instead as soon as the command line has passed its checks, in the background, while Hydra
composes the sweep once more. Each worker then takes a GPU as its home (a host-wide lock per
GPU, held while the worker lives; another sweep's workers take others), makes it the first GPU
its CUDA sees and starts the driver, then the context with cuDNN and cuBLAS, in threads
(`take_home`); its jobs ask for that GPU first (trainer/parallel_jobs.py, `settle_on`). Not
where the server still imports its preload: joblib's first dispatch waits for the server, and
the sweep's process with it (2.5 s on a 2-core CPU), instead of composing meanwhile.

The pool is joblib's reusable one, started by a Parallel call with the launcher's own settings:
hydra-joblib-launcher's Parallel call then finds it and reuses it, as joblib does for a loky
pool whose settings are unchanged, so no worker starts twice (tests/test_pool_ahead.py checks
that it is the same pool). Where a worker never comes, the others stop waiting for it after
ARRIVAL_WAIT_S and its jobs start the driver as before.

Owns: when the pool starts ahead, the workers' homes. Must not touch: the jobs (parallel_jobs).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from trainer import cuda_driver, forkserver, parallel_jobs

# How long a worker's first task waits for the others' (so that each worker takes one task, and
# with it a home): a worker forked from a server holding the preload starts in milliseconds.
ARRIVAL_WAIT_S = 2.0
_home: int | None = None  # this worker's GPU, whose lock it holds (its descriptor stays open)
_warming: Iterator[int] | None = None  # kept: joblib cancels a generator's tasks once it is dropped


def start_workers(composed: DictConfig) -> None:
    """The pool's workers started now, in the background, one home each, where they start at
    once (the server holds the preload), the jobs run on CUDA here and an NVIDIA driver is
    loaded (`composed`: the sweep's config with Hydra's node, from the command line's checks).
    Not CUDA's context where the jobs are deterministic: as in a run (trainer/perf/cuda_start.py),
    no convolution or matmul before their switches are set."""
    global _warming
    if not (forkserver.starts_at_once() and cuda_driver.loaded()):
        return
    if composed.device == "auto" or composed.device.startswith("cuda"):
        _warming = warm_pool(composed.hydra.launcher, gpus=None, context=not composed.deterministic)


def warm_pool(launcher: DictConfig, gpus: int | None, context: bool = True) -> Iterator[int] | None:
    """One task per worker of a joblib pool made as the launcher makes its own (`launcher`:
    hydra.launcher), each worker taking a home among `gpus` (None: the GPUs it sees) and, with
    `context`, starting CUDA's context there. Returns at once, the workers' pids to come
    (joblib's generator: it dispatches the tasks in a thread of its own, while this process goes
    on with Hydra), or None for one job at a time (joblib runs it in the sweep's own process)."""
    from hydra_plugins.hydra_joblib_launcher._core import process_joblib_cfg
    from joblib import Parallel, delayed

    settings = OmegaConf.to_container(launcher, resolve=True)
    settings.pop("_target_", None)
    settings["backend"] = "loky"  # as the launcher sets it
    process_joblib_cfg(settings)
    workers = int(settings["n_jobs"])
    if workers < 2:
        return None
    descriptor, arrivals = tempfile.mkstemp(prefix="trainer-pool-")
    os.close(descriptor)
    tasks = (delayed(take_home)(gpus, arrivals, workers, context) for _ in range(workers))
    return Parallel(**settings, return_as="generator_unordered")(tasks)


def take_home(gpus: int | None, arrivals: str, workers: int, context: bool = True) -> int:
    """In a worker: a home among the GPUs, where one is free (CUDA's driver, and with `context`
    its context, started there), then a wait for the pool's other workers to take a task each
    (`arrivals`: a file each task adds a byte to; the first task to leave removes it). Returns
    the worker's pid."""
    parallel_jobs.serve_the_sweep()  # as in a job: it ends with the sweep, loky keeps it
    global _home
    gpus = parallel_jobs.visible_gpus() if gpus is None else gpus
    if _home is None and gpus:
        _home = free_gpu(gpus, parallel_jobs.slot_folder())
        if _home is not None:
            parallel_jobs.settle_on(gpus, _home)
            if context:
                threading.Thread(target=start_cuda_on_home, name="cuda-home", daemon=True).start()
    deadline = time.monotonic() + ARRIVAL_WAIT_S
    with contextlib.suppress(FileNotFoundError):  # gone: every task has arrived, or given up
        descriptor = os.open(arrivals, os.O_WRONLY | os.O_APPEND)
        os.write(descriptor, b".")
        os.close(descriptor)
        while os.stat(arrivals).st_size < workers and time.monotonic() < deadline:
            time.sleep(0.005)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(arrivals)
    return os.getpid()


def start_cuda_on_home() -> None:
    """CUDA's context on the home GPU (cuda:0 here), with cuDNN's and cuBLAS's libraries loaded,
    before the worker's first job asks: the job's own start of them (trainer/perf/cuda_start.py)
    took 0.92 s of its set-up on 2 H200s; it then finds them started. Float32, the default layout:
    the libraries are what takes the time, the job's first kernels of its own precision load as
    it starts them. A failure here is the job's to report, in its own words."""
    import torch

    from trainer.perf.cuda_start import start_cuda

    start_cuda(torch.device("cuda", 0), lambda: None, torch.contiguous_format)


def free_gpu(gpus: int, folder: Path) -> int | None:
    """The first GPU no other worker has as its home, its lock taken for this process's life."""
    for index in range(gpus):
        if parallel_jobs.locked(folder / f"home{index}.lock") is not None:
            return index  # the descriptor stays open: the lock ends with the process
    return None
