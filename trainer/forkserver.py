"""The one process that tuner trials and DDP ranks are forked from: multiprocessing's forkserver,
which imports Hydra, torch and the trainer once, so that each process forked from it starts
without paying those imports again (2-3 s of CPU each on a 2-core host, and the same on every
restart of a DDP group or job of a DDP sweep).

Preloaded: the modules every run imports, the trainer's CLI and its Trainer (Hydra, torch),
torch._dynamo (torch.optim loads it when it makes an optimizer), TensorBoard's writer, and,
unless the caller's processes compile nothing (a DDP run with compile=false), inductor with its
cache keys (trainer/inductor_preload.py, imported so that it starts no CUDA), which a process
that compiles would otherwise import and work out at its first torch.compile.
None of the preloaded modules starts CUDA: each forked process starts its own context. Other
modules a run of some setting would not import (torchvision for the CNNs) stay out, unless the
caller names them (`also`: what its runs' model imports as it is built, trainer/models.py).

A forked process starts with the server's environment, from when the server started; the
caller's environment of now travels with each process (`environment_now`, `take_environment`).

A process is started with Ctrl-C and SIGTERM held (`start_process`): the server forks the child
before the caller sends it its work, so a stop in between left a child that read half its work
and printed `EOFError: Ran out of input` on the caller's terminal after the caller's last line,
with no pid known to stop it by.

Owns: the server's context, preload and stop, that hand-over, a process's start and its end
with the caller (`follow_the_caller`). Must not touch: what a forked process runs
(trainer.trial_fork, trainer.distributed).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import multiprocessing.spawn
import multiprocessing.util
import os
import signal
import sys
import threading

PRELOAD = (
    "trainer.__main__",
    "trainer.trainer",
    "torch._dynamo",
    "torch.utils.tensorboard",
)
# For processes that compile, after PRELOAD: a server for a DDP run that compiles nothing leaves
# it out (on a 2-core CPU it cost 1.4 s of CPU beside the launcher's own start).
COMPILING = ("trainer.inductor_preload",)
# This process's environment when this module was imported: in the server (which imports it
# with PRELOAD), the environment every forked process starts with.
_AT_IMPORT = dict(os.environ)

STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
_SPAWN = multiprocessing.util.spawnv_passfds  # how multiprocessing starts its server: a new interpreter

_context: multiprocessing.context.ForkServerContext | None = None
_with_preload = False  # the server was forked from this process, its preload in it (`start`)


def available() -> bool:
    """Whether this platform has a forkserver (not on Windows)."""
    return "forkserver" in multiprocessing.get_all_start_methods()


def forkserver(
    compiles: bool = True, also: tuple[str, ...] = ()
) -> multiprocessing.context.ForkServerContext:
    """multiprocessing's forkserver context, its server preloading PRELOAD, COMPILING where
    the processes forked from it may compile, and `also`, when it starts (at the first process
    forked from it; it lives until this process ends). A server already running keeps what it
    preloaded."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        atexit.register(stop)
    if not running():  # the list counts when the server starts
        _context.set_forkserver_preload(list(PRELOAD + (COMPILING if compiles else ()) + also))
    return _context


def running() -> bool:
    """Whether this process's server runs (multiprocessing keeps its pid once started)."""
    return getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None) is not None


def stop() -> None:
    """The server killed and reaped, if it runs: at this process's exit (atexit). Left to
    itself it ends once it sees this process gone, by tearing down an interpreter that holds
    torch, and meanwhile holds this process's stdout and stderr: a sweep piped into `tee` ended
    1 s after its process on a 2-core CPU. It holds nothing to keep: the processes forked from
    it are each their own. multiprocessing's own stop (`_stop`, what its tests use) then only
    reaps it and removes its socket."""
    server = multiprocessing.forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    server._stop()


def start(compiles: bool = True, also: tuple[str, ...] = ()) -> None:
    """The server started now, if it is not running yet; it imports its preload in its own
    process while this one goes on, or, where this process holds that preload already (a command
    forked from `python -m trainer.serve`), it is forked from this one with it."""
    forkserver(compiles, also)
    if running() or not holds_the_preload():
        multiprocessing.forkserver.ensure_running()
        return
    multiprocessing.resource_tracker.ensure_running()  # spawned as usual: it imports nothing
    multiprocessing.util.spawnv_passfds = forked_server
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        multiprocessing.util.spawnv_passfds = _SPAWN
    global _with_preload
    _with_preload = running()


def starts_at_once() -> bool:
    """Whether this process's server runs with its preload imported from the start (forked from
    this process by `start`): a process forked from it starts in milliseconds."""
    return _with_preload and running()


def holds_the_preload() -> bool:
    """Whether a server forked from this process would start with its preload imported and
    could fork processes that start CUDA: every module of it imported, one thread (a fork copies
    only the calling thread, and a lock another one held stays held), and a fork that torch does
    not mark (`forks_unmarked`)."""
    preload = multiprocessing.forkserver._forkserver._preload_modules
    if not os.path.isdir("/proc/self/fd") or threading.active_count() != 1:
        return False  # /proc/self/fd: forked_server's way to its descriptors (Linux)
    if not all(name in sys.modules for name in preload):
        return False
    return forks_unmarked() if "torch" in sys.modules else True


def forks_unmarked() -> bool:
    """Whether a process forked from this one now could use CUDA. torch marks every process
    forked after this one asked CUDA anything, even `torch.cuda.is_available()` (which a run
    asks when it picks its device) on a host without a GPU, while `torch.cuda.is_initialized()`
    stays False; a process so marked refuses CUDA. Nothing in torch tells the parent, so a
    child forked to look says (milliseconds). Nor does torch know of the driver this process
    started itself (trainer/cuda_driver.py)."""
    import torch

    from trainer import cuda_driver

    if torch.cuda.is_initialized() or cuda_driver.started():
        return False
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one byte, then gone without running anything of the parent's
        os.write(write_end, b"1" if torch.cuda._is_in_bad_fork() else b"0")
        os._exit(0)
    os.close(write_end)
    try:
        answer = os.read(read_end, 1)
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
    return answer == b"0"


def forked_server(executable: str, args: list[str], passfds: list[int]) -> int:
    """multiprocessing's server started as a fork of this process where ensure_running would
    start a new interpreter that imports the preload again (4-5 s on an H100 host, the first job
    of a parallel sweep waits for it): the same main, with the same descriptors; those of its
    own it would not have inherited across exec (the write end of its caller's "alive" pipe) are
    closed. Python 3.14's server takes an authentication key as a third: started as usual."""
    if len(passfds) != 2:
        return _SPAWN(executable, args, passfds)
    listener, alive_r = passfds
    pid = os.fork()
    if pid:
        return pid
    try:
        pipe = os.fstat(alive_r)
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            with contextlib.suppress(OSError):
                same = os.fstat(fd)
                if fd != alive_r and (same.st_ino, same.st_dev) == (pipe.st_ino, pipe.st_dev):
                    os.close(fd)
        server = multiprocessing.forkserver._forkserver
        server._lock = threading.Lock()  # held by ensure_running in the process forked from
        data = multiprocessing.spawn.get_preparation_data("ignore")
        paths = {key: value for key, value in data.items() if key in ("main_path", "sys_path")}
        multiprocessing.forkserver.main(listener, alive_r, server._preload_modules, **paths)
    finally:
        os._exit(1)


def start_method(compiles: bool = True) -> str:
    """How to start processes that may be forked from the server: "forkserver", with the server
    started now (its imports then overlap what the caller does before the first process;
    `compiles` as for `start`), or "spawn" where the platform has none."""
    if not available():
        return "spawn"
    start(compiles)
    return "forkserver"


def environment_now() -> dict[str, str]:
    """The caller's environment, to travel with a process forked from the server."""
    return dict(os.environ)


def take_environment(environment: dict[str, str]) -> None:
    """In a forked process: the caller's `environment`, and over it what was set in this process
    since the fork (a DDP rank's RANK, WORLD_SIZE, ... from the elastic agent)."""
    set_since = {name: value for name, value in os.environ.items() if _AT_IMPORT.get(name) != value}
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(set_since)


def start_process(process: multiprocessing.process.BaseProcess) -> None:
    """process.start(), with Ctrl-C and SIGTERM held until the process has its work and its pid
    is known; one that came meanwhile is raised as it returns, where the caller can stop it.
    The server is started first: multiprocessing, as it starts its resource tracker with the
    server, unblocks both signals on its way out."""
    start()
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def follow_the_caller() -> None:
    """In a process forked from the server (a sweep's worker, a tuner's trial): it ends when the
    server does, and the server when its caller does, however the caller ended (kill -9
    included; Linux). multiprocessing hands every process forked from the server a copy of the
    pipe whose closing tells the server that its caller is gone (for a process that starts its
    own through the same server), so the server outlived a killed caller as long as any of them
    ran. This one lets go of its copy; a process it asks the server for later comes from a
    server of its own. Nothing anywhere else (the caller holds no such copy)."""
    from trainer.trials import die_with_parent

    server = multiprocessing.forkserver._forkserver
    if server._forkserver_alive_fd is None or server._forkserver_pid is not None:
        return
    os.close(server._forkserver_alive_fd)
    server._forkserver_alive_fd = None
    die_with_parent()
