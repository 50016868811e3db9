"""A served command's process, forked from the server (trainer/serve/server.py): it becomes
the command as `python -m trainer` would have run it, then runs the trainer's main.

It takes the command's standard descriptors, folder, environment, first sys.path entry and
process settings (trainer/serve/settings.py), in a session of its own (the client relays the
terminal's signals to its process group), with the signal handlers and multiprocessing start
method of a fresh process, and counts its age (the run's startup_s and wall_s) from the
command's start, not from the fork.

Owns: that transformation. Must not touch: the run (trainer.__main__).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
from typing import NoReturn

from trainer.serve import settings


def run(request: dict, fds: list[int], server_fds: list[int]) -> NoReturn:
    os.setsid()
    signal.set_wakeup_fd(-1)
    for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for fd in server_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = request["path0"]
    # the command's umask, limits, CPUs, priority, ignored signals and buffering; its signal
    # mask last: the server held the stop signals across the fork until these handlers were set
    settings.apply(request["settings"])
    multiprocessing.set_start_method(None, force=True)
    from trainer import __main__ as cli
    from trainer import bytecode, process_exit, timing

    timing.count_from(request["started_at"], served_by=os.getppid())
    bytecode.cache_bytecode()  # the environment the run's own processes start with
    sys.argv = [cli.__file__, *request["argv"]]
    process_exit.run(cli.main)
