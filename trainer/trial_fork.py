"""Trials forked from one process that has imported the trainer once.

A fresh `python -m trainer` trial pays its start-up and teardown every time: on one H200 host
(outputs/readme/trial_overhead_h200_2026-11-25.md), 11.5 s of imports and set-up before the
first step and 5 s of interpreter teardown after metrics.json, around 1.2 s of training. Here
multiprocessing's forkserver imports Hydra, torch and the trainer once, and each trial is a
process forked from it. That process has never touched CUDA, compiled a graph or run a kernel,
so a trial still starts with its own CUDA context, compiled graphs, cuDNN plans and allocator,
as a fresh one does. Once the trainer's main has returned, with everything the run keeps
written, the trial ends with os._exit: no threads joined, no atexit handlers, no teardown of
the interpreter; whatever it left running (inductor's compile workers, loader workers, DDP
ranks) is killed with its process group.

The server and what it preloads are trainer/forkserver.py's.

Owns: one forked trial (`forked_trial`) and the check that the preloaded modules left CUDA
untouched. Must not touch: what a trial's numbers mean (trainer.trials).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

from trainer.forkserver import environment_now, follow_the_caller, forkserver, start_process, take_environment
from trainer.process_exit import exit_code_of
from trainer.trials import Trial, kill_tree, trial_left

NO_CUDA_AFTER_FORK = (
    "forked trial: CUDA was started in the process the trial was forked from, and a forked "
    "process cannot use it: run the trials fresh (--trial-start fresh)"
)


def cuda_started_before_fork() -> bool:
    """Whether the process this one was forked from had started CUDA, which a forked process
    cannot use: torch marks such a child when it forks (the flag it checks before refusing CUDA
    with a traceback). That libcuda is mapped says nothing: `import torch` maps it (torch 2.11,
    CUDA 13) and starts nothing."""
    import torch  # preloaded in the forkserver: no import time here

    return torch.cuda._is_in_bad_fork()


def trial_process(overrides: list[str], output_dir: str, environment: dict[str, str] | None = None) -> None:
    """The forked trial: `python -m trainer OVERRIDES` as its main, its stdout and stderr into
    output_dir, in a process group of its own, with the caller's environment (the forkserver
    has the one it started with; what a module read from it when it was imported stays)."""
    os.setsid()  # a trial stopped at its limit is stopped with everything it started
    follow_the_caller()  # ends with the tuner, however the tuner was killed
    if environment is not None:
        take_environment(environment)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        try:
            handle = os.open(os.path.join(output_dir, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError:  # the caller stopped while this trial started and took its folder away
            os._exit(1)
        os.dup2(handle, fd)
        os.close(handle)
    # As in a fresh process writing to a pipe: stdout not line-buffered (the forkserver's may
    # have been a terminal), and multiprocessing's default start method, where a child of the
    # forkserver has the forkserver's (a library's Pool or lock would otherwise go through a
    # server that preloads nothing and registers its semaphores with the tuner's tracker).
    sys.stdout.reconfigure(line_buffering=False)
    multiprocessing.set_start_method(None, force=True)
    if cuda_started_before_fork():
        print(NO_CUDA_AFTER_FORK, file=sys.stderr)
        sys.exit(1)
    from trainer import __main__ as cli

    sys.argv = [cli.__file__, *overrides]  # as `python -m trainer` sets it
    code = exit_code_of(cli.main)
    # Everything the run keeps is written and closed by now (metrics.json, checkpoints and
    # TensorBoard's files; the log flushes every line); os._exit skips the rest of the exit.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def stop_group(process: multiprocessing.process.BaseProcess) -> None:
    """SIGKILL to the trial's process group (it leads one from its first line) and everything
    under it (trainer.trials.kill_tree), or to the trial alone if it has not made its group yet."""
    kill_tree(process.pid)
    if process.exitcode is None:  # still in the forkserver's group, or just killed and not yet reaped
        with contextlib.suppress(ProcessLookupError):
            process.kill()


def ready() -> None:
    """A forked process's whole work when start_forkserver waits for the server."""


def start_forkserver(also: tuple[str, ...] = ()) -> None:
    """Starts the forkserver now and waits until its imports are done (seconds), so that the
    first trial's time is a trial's like the others': the server imports PRELOAD (and `also`,
    what the trials' model imports as it is built) before it forks anything, so the first trial
    would otherwise wait for it. A process that does nothing is forked to know."""
    waiter = forkserver(also=also).Process(target=ready)
    start_process(waiter)
    waiter.join()


def forked_trial(overrides: list[str], run_dir: Path, timeout_s: float | None = None) -> Trial:
    """One `python -m trainer OVERRIDES hydra.run.dir=run_dir`, forked from the preloaded server;
    what it printed is kept in run_dir/output.log, as trainer.trials.run_trial keeps it."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="trial-") as output_dir:
        arguments = ([*overrides, f"hydra.run.dir={run_dir}"], output_dir, environment_now())
        process = forkserver().Process(target=trial_process, args=arguments)
        try:
            start_process(process)
            process.join(timeout_s)
            timed_out = process.exitcode is None
        finally:
            if process.pid is not None:  # none where the start itself failed
                stop_group(process)  # at the limit the trial itself; always what it left running
                process.join()
        output = Path(output_dir)
        stdout, stderr = (
            (output / name).read_text(errors="replace") if (output / name).is_file() else ""
            for name in ("stdout", "stderr")
        )
    returncode = None if timed_out else process.exitcode
    return trial_left(run_dir, returncode, stdout, stderr, time.perf_counter() - started, timeout_s)
