"""Inductor's compile-worker pool over a run's life. The pool is torch's: a sidecar process
(`python -m torch._inductor.compile_worker`, which imports torch anew) and its workers, started at
a run's first compile. Where the process runs a sweep's next job, it is kept for that job;
otherwise it is stopped once the warm-up has compiled every graph the run uses, in a thread
beside the training, and a pool that is still starting then is ended at once instead of waited
for. A pool kept for a sweep's jobs is ended after the last one.

Owns: when the pool stops, and how. Must not touch: whether or what a run compiles
(trainer/perf/model.py).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from types import ModuleType

log = logging.getLogger(__name__)

_workers_serve_the_sweep = False  # this process runs a sweep's jobs (keep_compile_workers)


def keep_compile_workers() -> None:
    """In a process that runs a sweep's jobs one after another (the basic launcher's, a parallel
    sweep's worker; not a job in a process of its own, as a Slurm launcher's): inductor's
    compile-worker pool, once started, serves every job, and goes with the process (its exit,
    or the parallel sweep killing its workers). Stopped after each job's warm-up, it was started
    again by the next job's compile, which loads its kernels through the pool even from a warm
    cache, and that job then waited for the pool it had just started to be stopped: 1.2 s a job
    after the first under the basic launcher, 1.5-2.3 s in a parallel sweep (2 H200,
    recipe=fastcnn_94, outputs/readme/gpu_h200x2_h100_2026-11-27.md)."""
    global _workers_serve_the_sweep
    _workers_serve_the_sweep = True


def stop_compile_workers() -> threading.Thread | None:
    """Once the warm-up has compiled every graph the run uses: inductor's compile-worker pool
    is stopped now, in a thread beside the training, not by torch's exit handler after
    metrics.json. There it held the process (a tuner trial on an H200, torch 2.11: exit 1.1 s
    after metrics.json with the pool, 0.3 s without). A compile after this (none is expected)
    starts a fresh pool. Not a daemon thread: the process's exit waits for it. Nothing where the
    pool serves a sweep's next job (keep_compile_workers)."""
    async_compile = sys.modules.get("torch._inductor.async_compile")
    if async_compile is None or _workers_serve_the_sweep:  # nothing compiled, or more jobs to come
        return None
    stopping = threading.Thread(target=stop_pool, args=(async_compile,), name="stop-compile-workers")
    stopping.start()
    return stopping


def stop_pool(async_compile: ModuleType, end_served: bool = False) -> None:
    """torch's own stop of every pool (shutdown_compile_workers); a pool that never became ready
    is killed, not waited for. torch's stop sends the sidecar its order and waits for it to exit,
    and a sidecar still importing torch reads the order only once its imports are done. A run
    forked from preloaded modules (a tuner's trial) compiles from a warm cache before its
    sidecar is up, and its end waited 2.9-7.6 s for it (one H100, recipe=fastcnn_94,
    outputs/readme/gpu_h100_2026-11-27b.md). Such a pool has served nothing: inductor hands a
    kernel to the pool only once the pool has answered its readiness probe, and compiles it in
    the process before that. `end_served`: a pool that served is ended too (end_sweep_pool)."""
    served = pool_served(async_compile)
    sidecars = running_sidecars(async_compile) if end_served or not served else []
    if not sidecars:
        async_compile.shutdown_compile_workers()
        return
    stopping = threading.Thread(target=async_compile.shutdown_compile_workers, name="stop-compile-pool")
    stopping.start()
    for pool, process in sidecars:
        if ordered_to_stop(pool, stopping):
            kill_with_workers(process.pid)
            if not served:
                log.info(
                    "ended inductor's compile workers, still starting after the warm-up "
                    "(they compiled nothing)"
                )
    stopping.join()


def end_sweep_pool() -> None:
    """After a sweep's last job, in the process that ran its jobs one after another
    (keep_compile_workers): the pool that served them is ended, not asked to stop. torch's stop
    at exit has the sidecar shut its workers down and waits for their interpreters to tear
    down: 1.1 s after a basic sweep's last metrics.json (one H100, recipe=fastcnn_94, 2 jobs;
    README, "From Enter to result"). Every job has compiled what it ran: the pool holds
    nothing to keep. Ended as a pool still starting is (stop_pool): killed once torch has sent
    its order, so that torch reads the end as the stop it asked for."""
    async_compile = sys.modules.get("torch._inductor.async_compile")
    if async_compile is not None and _workers_serve_the_sweep:
        stop_pool(async_compile, end_served=True)


def pool_served(async_compile: ModuleType) -> bool:
    """Whether the pool answered inductor's readiness probe (from then on it takes kernels)."""
    ready = getattr(getattr(async_compile, "AsyncCompile", None), "_ready_future", None)
    return ready is not None and ready.done()


def running_sidecars(async_compile: ModuleType) -> list[tuple[object, object]]:
    """(pool, sidecar process) of each pool with a sidecar still running. The attributes are
    torch's own (SubprocPool, torch 2.11 to 2.14); a torch without them only loses the early end."""
    found = []
    for pool in list(getattr(async_compile, "_pool_set", ())):
        process = getattr(pool, "process", None)
        if process is not None and hasattr(pool, "running") and process.poll() is None:
            found.append((pool, process))
    return found


def ordered_to_stop(pool: object, stopping: threading.Thread) -> bool:
    """Whether torch's stop has sent this pool its order and is now waiting for the sidecar: then
    a kill ends the wait, and torch, no longer counting the pool as running, reads the sidecar's
    end as the stop it asked for (before that, as a crash, with an error on the console)."""
    while stopping.is_alive():
        write_pipe = getattr(pool, "write_pipe", None)
        if not getattr(pool, "running", True) and write_pipe is not None and write_pipe.closed:
            return True
        time.sleep(0.005)
    return False  # stopped by itself meanwhile


def kill_with_workers(sidecar: int) -> None:
    """SIGKILL to the sidecar and every process under it (its workers, if it had begun them)."""
    from trainer import process_tree

    process_tree.kill([sidecar, *process_tree.descendants(sidecar)])
