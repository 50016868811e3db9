"""hydra/launcher=parallel: a sweep's jobs side by side, on hydra-joblib-launcher's process pool.

    python -m trainer -m hydra/launcher=parallel seed=0,1,2,3        # one job per GPU at a time
    python -m trainer -m hydra/launcher=parallel hydra.launcher.n_jobs=2 amp=false,true   # on a CPU

The engine is Hydra's joblib launcher (joblib's loky workers: processes that the pool starts,
reuses and stops); what it does not know about, this module adds around each job:
  - n_jobs defaults to the GPUs of the host, or 1 without one (`default_jobs`, a resolver,
    counting them without torch);
  - each job holds one GPU for its whole run: a lock per GPU, host-wide, taken before training
    and freed after, so two jobs never share a GPU whatever the pool does (`gpu_slot`); a
    worker's next job asks first for the GPU its last one ran on;
  - each job gets its share of the cores as torch threads (`threads_per_job`);
  - a sweep job ends by returning, never by exiting its worker: the parent reads every job's
    metrics.json at the end and says which failed or stopped (trainer/sweep_summary.py);
  - once every job has returned, the pool's workers are killed (`stop_workers`);
  - where the command line names this launcher, the pool's workers are forked from the
    trainer's forkserver (trainer/forkserver.py), started as the sweep's process starts: its
    imports (Hydra, torch, the trainer) run beside the sweep's own start-up, and a worker
    begins its first job without them (`workers_from_forkserver`); such a worker ends with
    the sweep's process, even one killed by SIGKILL. A launcher chosen in a config file
    instead gets loky's own workers, which import all that themselves.
  - a worker's CUDA sees its first job's GPU as cuda:0, so that every GPU reads torch's one
    compile cache (`cuda_index`), and its driver starts as soon as that is set
    (trainer/cuda_driver.py), or before its first job where the pool started ahead with a
    home GPU per worker (trainer/pool_ahead.py, `settle_on`);
Owns: those seven. Must not touch: what a job trains (trainer/trainer.py), the run folder.
No torch at import: the resolver runs in the parent, before any job.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from omegaconf import DictConfig

from trainer import cuda_driver

LAUNCHER_TARGET = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
SLOT_WAIT_S = 0.5
# The GPU this worker's last job ran on. Its next job asks for that one first: the worker's CUDA
# context, cuDNN plans and compiled graphs are there, and another GPU would start a second context.
_last_gpu: int | None = None
# The sweep's GPUs as the host names them (CUDA_VISIBLE_DEVICES's entries, or their indices), and
# the order this worker's CUDA sees them in: its first job's GPU first (`cuda_index`).
_host_gpus: list[str] | None = None
_worker_order: list[str] | None = None


def nvidia_driver_here() -> bool:
    """Whether a GPU could be here: an NVIDIA driver loaded, or CUDA_VISIBLE_DEVICES set."""
    return cuda_driver.loaded() or "CUDA_VISIBLE_DEVICES" in os.environ


def visible_gpus() -> int:
    """The GPUs a job here could use, counted without starting CUDA (torch only where an NVIDIA
    driver is loaded, so that a CPU host's sweep does not wait for torch to import)."""
    if not nvidia_driver_here():
        return 0
    import torch

    return torch.cuda.device_count()


@functools.cache  # the container's GPUs for the process's life: a worker forked after the count keeps it
def nvml_gpu_count() -> int | None:
    """The host's GPUs as NVIDIA's management library counts them (those this container was
    given), or None where it cannot be read. By hand through ctypes: torch's count needs torch
    imported and the CUDA driver started, 1-2 s in the sweep's parent before any job starts, and
    the library's Python binding (nvidia-ml-py) is not among torch's dependencies."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    count = ctypes.c_uint(0)
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        return count.value if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0 else None
    finally:
        nvml.nvmlShutdown()


def cuda_visible(count: int, visible: str | None) -> int:
    """Of `count` GPUs, how many CUDA_VISIBLE_DEVICES leaves, read as CUDA reads it: the list up
    to its first empty or out-of-range index (UUIDs and MIG names counted as listed)."""
    if visible is None:
        return count
    listed = 0
    for entry in visible.split(","):
        entry = entry.strip()
        if not entry or (entry.lstrip("-").isdigit() and not 0 <= int(entry) < count):
            break
        listed += 1
    return min(listed, count)


def default_jobs() -> int:
    """hydra.launcher.n_jobs when not given: one job per GPU, or 1 on a host without one. The
    count is read without torch where the management library answers; a count that differs from
    torch's only changes how many jobs wait for a GPU (each job takes a GPU torch sees)."""
    count = nvml_gpu_count() if cuda_driver.loaded() else None
    if count is None:
        return max(1, visible_gpus())
    return max(1, cuda_visible(count, os.environ.get("CUDA_VISIBLE_DEVICES")))


def is_parallel(launcher_target: str | None) -> bool:
    return launcher_target == LAUNCHER_TARGET


def workers_from_forkserver() -> None:
    """The pool's workers forked from the trainer's forkserver, which starts now. On a 2-core
    CPU a worker's first job then began 0.4 s after its fork instead of 2.7 s after its start
    (README, "Sweeps on every GPU"). loky takes any of multiprocessing's start methods; the
    thread limits joblib would set in a loky worker's environment are each job's own here
    (`job_resources`). Inductor is not preloaded: the server would import it before forking any
    worker, and every worker would wait for it. A job that compiles imports it itself as its
    set-up begins, as a single run does (trainer/perf/compile_keys.py). On 2
    H200s (plain, 4 seeds of recipe=fastcnn_94) the first set-up began 3.0-3.3 s after Enter
    instead of 4.6-4.7 s, and the parallel sweep took 12.2-12.5 s instead of 12.9-13.7 s; on a
    2-core CPU the preload cost 1.4 s of CPU beside the sweep's start (README, "Sweeps on every
    GPU"). A command served by `python -m trainer.serve` has inductor in its server already."""
    from trainer import forkserver

    if forkserver.start_method(compiles=False) == "forkserver":  # joblib's import can wait
        from joblib.externals.loky.backend.context import set_start_method

        set_start_method("forkserver", force=True)


def cuda_index(gpus: int, slot: int) -> int:
    """The index this worker's torch gives the sweep's GPU `slot`. Before CUDA starts in the
    worker, its CUDA_VISIBLE_DEVICES puts that GPU first, so it is cuda:0 here. torch's compile
    caches key a graph by its tensors' device index: a job on cuda:1 missed the graphs a run on
    cuda:0 had cached and compiled anew, 16.8 s against 3.5 s (2 H200, recipe=fastcnn_94,
    outputs/readme/gpu_h200x2_h100_2026-11-27.md). Seen as cuda:0 everywhere, every GPU reads one cache."""
    global _host_gpus, _worker_order
    import torch

    if _worker_order is None and not torch.cuda.is_initialized():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        _host_gpus = [entry.strip() for entry in visible.split(",")][:gpus] if visible else []
        _host_gpus = _host_gpus if len(_host_gpus) == gpus else [str(index) for index in range(gpus)]
        _worker_order = [_host_gpus[slot], *_host_gpus[:slot], *_host_gpus[slot + 1 :]]
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(_worker_order)
    if _worker_order is None:  # CUDA started before this worker's first job: the host's order
        return slot
    return _worker_order.index(_host_gpus[slot])


def settle_on(gpus: int, slot: int) -> None:
    """A worker's home GPU (trainer/pool_ahead.py) before its first job: what its CUDA sees is
    set with that GPU first, the driver starts on it, and the first job asks for it first."""
    global _last_gpu
    _last_gpu = slot
    cuda_index(gpus, slot)
    cuda_driver.start_ahead()


def threads_per_job(n_jobs: int) -> int:
    """Each job's torch threads on a CPU: the cores shared out, at least one."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, n_jobs))


def slot_folder() -> Path:
    """Host-wide, per user: two sweeps on one host also keep to a GPU each."""
    folder = Path(tempfile.gettempdir()) / f"trainer-gpu-slots-{os.getuid()}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextlib.contextmanager
def gpu_slot(gpus: int, folder: Path | None = None, prefer: int | None = None) -> Iterator[int]:
    """The index of a GPU no other job holds, `prefer` first where it is free, held until the
    block ends; waits while every GPU is held (more jobs than GPUs). The lock is the kernel's
    flock, so it ends with the process that held it, however that process ends."""
    folder = folder or slot_folder()
    order = sorted(range(gpus), key=lambda index: index != prefer)
    while True:
        for index in order:
            descriptor = locked(folder / f"gpu{index}.lock")
            if descriptor is None:
                continue
            try:
                yield index
            finally:
                fcntl.flock(descriptor, fcntl.LOCK_UN)
                os.close(descriptor)
            return
        time.sleep(SLOT_WAIT_S)


def locked(path: Path) -> int | None:
    """A descriptor of `path` holding its exclusive flock, or None where another process holds
    it (the lock ends when the descriptor is closed, or with the process)."""
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        os.close(descriptor)
        if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        return None
    return descriptor


def serve_the_sweep() -> None:
    """In a worker, at each of its tasks (a job, or its home: trainer/pool_ahead.py): a worker
    forked from the server ends with the sweep, even one killed (forkserver.follow_the_caller),
    and loky keeps it for the sweep's later jobs (`keep_worker`)."""
    from trainer.forkserver import follow_the_caller

    follow_the_caller()
    keep_worker()


def keep_worker() -> None:
    """This worker kept for the sweep's later jobs however much a job grows it. With psutil
    installed, loky takes a worker's memory after its first task as its size and replaces a
    worker grown 300 MB beyond it, as leaking: after a first task smaller than a job (a home,
    trainer/pool_ahead.py; a small model before a large one), the later jobs started cold in new
    workers (a traced sweep on 2 H100s: 1.6 s more set-up and compile each). loky has no setting
    for its check: its bound is raised past any growth. Turning psutil off in loky instead would
    make it collect garbage between all tasks."""
    from joblib.externals.loky import process_executor

    process_executor._MAX_MEMORY_LEAK_SIZE = sys.maxsize


def stop_workers() -> None:
    """Once a parallel sweep is over: its pool's workers are killed, not asked to exit. Every
    job has returned by then, its files written and closed; an exiting worker would only tear
    down its interpreter, torch and its CUDA context, and the sweep waited for it (1.1 s on a
    2-core CPU, tiny jobs, before anything else ended the process). loky's own shutdown kills
    each worker's descendants too. Nothing where no pool was started (the basic launcher, in a
    process that may have loky imported all the same: python -m trainer.serve preloads it), where
    asking for the pool would start one, and loky's resource tracker with it (0.3 s)."""
    reusable = sys.modules.get("joblib.externals.loky.reusable_executor")
    if reusable is None or getattr(reusable, "_executor", None) is None:
        return
    executor = reusable.get_reusable_executor(reuse=True)
    kill_workers_and_what_runs_under_them(executor)
    executor.shutdown(wait=True, kill_workers=True)


def kill_workers_and_what_runs_under_them(executor) -> None:
    """SIGKILL to the pool's workers, then to every process under them (inductor's
    compile-worker pools: a sidecar and a worker per core each), the trees read from /proc first
    (a killed worker's children are handed to init). loky kills each tree itself, but without
    psutil it runs `pgrep -P` once per process in it: 0.35 s at the end of a 2-GPU sweep on a
    32-core host, after its last job. Workers first: a worker that saw its compile pool die
    logged "SubprocPool unclean exit". loky's shutdown then finds them gone."""
    from trainer import process_tree

    workers = [worker.pid for worker in list(getattr(executor, "_processes", {}).values())]  # loky's table
    below = process_tree.descendants(*workers)
    process_tree.kill(workers)
    process_tree.kill(below)


@contextlib.contextmanager
def job_resources(cfg: DictConfig, n_jobs: int | None) -> Iterator[tuple[DictConfig, str | None]]:
    """A parallel sweep's job (`n_jobs` set) with what it may use: its share of the CPU threads,
    and a GPU of its own where the job would run on CUDA; and multiprocessing's default start
    method as a fresh process has it, for a library inside the job (a DataLoader's workers),
    not the pool's (forkserver or loky's own). Yields the job's config and the name of its GPU
    as the host numbers it (None without one). Other runs: as they are."""
    if n_jobs is None:
        yield cfg, None
        return
    import torch

    serve_the_sweep()
    multiprocessing.set_start_method(None, force=True)
    torch.set_num_threads(threads_per_job(n_jobs))
    gpus = visible_gpus() if cfg.device in ("auto", "cuda") else 0
    if gpus == 0:
        yield cfg, None
        return
    global _last_gpu
    with gpu_slot(gpus, prefer=_last_gpu) as slot:
        _last_gpu = slot
        cfg.device = f"cuda:{cuda_index(gpus, slot)}"  # made current by the job's set-up
        cuda_driver.start_ahead()  # what CUDA sees is set: its driver starts beside the job's start
        try:
            yield cfg, f"cuda:{slot}"  # metrics.json records it
        finally:
            torch.cuda.empty_cache()  # this worker's cached memory, before another job takes the GPU
