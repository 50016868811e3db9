"""What a process takes from its parent besides its environment, which a served command's
process would otherwise take from the server: its umask, CPU affinity, priority, resource limits,
signal mask and ignored signals (nohup's SIGHUP), whether its stdout is unbuffered (`python -u`).
`of_this_process` reads them in the command's process; `apply` sets them in the served one, with
the time zone and temporary folder of the command's environment read anew. Standard library only.

Owns: that list. Must not touch: the environment's key (protocol.py), which decides instead
what cannot be carried over (the interpreter's flags, the cgroup).
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import sys
import tempfile
import time

LIMITS = (
    "RLIMIT_NOFILE",
    "RLIMIT_FSIZE",
    "RLIMIT_CORE",
    "RLIMIT_AS",
    "RLIMIT_DATA",
    "RLIMIT_STACK",
    "RLIMIT_NPROC",
)
CARRIED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGPIPE)


def of_this_process() -> dict:
    umask = os.umask(0)
    os.umask(umask)
    limits = {name: resource.getrlimit(getattr(resource, name)) for name in LIMITS if hasattr(resource, name)}
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    ignored = [int(signum) for signum in CARRIED_SIGNALS if signal.getsignal(signum) is signal.SIG_IGN]
    return {
        "umask": umask,
        "limits": limits,
        "affinity": affinity,
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "mask": sorted(int(signum) for signum in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "ignored": ignored,
        "unbuffered": bool(getattr(sys.stdout, "write_through", False)),
    }


def apply(settings: dict) -> None:
    """In the served process, after it took the command's environment."""
    os.umask(settings["umask"])
    for name, (soft, hard) in settings["limits"].items():
        with contextlib.suppress(ValueError, OSError):  # a limit above the server's own hard one stays
            resource.setrlimit(getattr(resource, name), (soft, hard))
    if settings["affinity"] is not None:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, settings["affinity"])
    with contextlib.suppress(OSError):  # lower than the server's: allowed; higher needs privileges
        os.setpriority(os.PRIO_PROCESS, 0, settings["nice"])
    for signum in settings["ignored"]:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, settings["mask"])
    time.tzset()  # TZ as the command has it
    tempfile.tempdir = None  # TMPDIR as the command has it
    sys.stdout.reconfigure(line_buffering=os.isatty(1), write_through=settings["unbuffered"])
