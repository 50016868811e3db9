"""`python -m trainer ...` handing its command to a server (trainer/serve/server.py), before it
imports anything but the standard library: where one serves this environment, the command runs
in a process forked from it, with this command's descriptors (the terminal, the pipes, the
files it was redirected to), folder, environment and arguments, and this process waits for it
and ends as it ended. Ctrl-C and the other stop signals sent to this process go on to the run,
and a run whose command was killed outright is stopped as by SIGTERM (its checkpoint saved).

Not handed over: with TRAINER_SERVE=0, under torchrun (whose ranks are its own processes), or
where no server answers for this environment (then nothing is printed: the command runs here).

Owns: the hand-over and the wait. Must not touch: anything the command does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time

from trainer.serve import protocol

RELAYED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
STANDARD_FDS = (0, 1, 2)


_tried = False


def hand_over_command() -> None:
    """This process's command line to a server, once (`python -m trainer` asks before its
    imports, the console script in cli()); returns where none took it."""
    global _tried
    if _tried:
        return
    _tried = True
    from trainer.timing import process_age_s

    hand_over(sys.argv[1:], time.time() - process_age_s())


def wanted() -> bool:
    if os.environ.get(protocol.SWITCH_VARIABLE, "1").lower() in ("0", "false", "off", "no"):
        return False
    return "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_RANK" not in os.environ


def connect() -> socket.socket | None:
    """A connection to the server of this environment, or None where none answers."""
    path = protocol.socket_path(protocol.environment_key())
    if not path.exists():
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except OSError:  # a server killed outright leaves its socket: nothing listens
        sock.close()
        return None
    return sock


def hand_over(argv: list[str], started_at: float) -> None:
    """Runs the command in a served process and ends this one as that one ended; returns only
    where it was not handed over (no server, TRAINER_SERVE=0, a closed standard descriptor)."""
    if not wanted():
        return
    try:
        for fd in STANDARD_FDS:
            os.fstat(fd)
    except OSError:
        return
    sock = connect()
    if sock is None:
        return
    request = {
        "argv": argv,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "path0": sys.path[0],  # `python -m` puts the command's folder first, a script its own
        "started_at": started_at,
    }
    # Ctrl-C before the run's pid is known would leave a traceback here and the run going on:
    # held until it can be relayed (or, where no run was forked, until the command runs here).
    held = signal.pthread_sigmask(signal.SIG_BLOCK, RELAYED)
    with sock:
        try:
            protocol.send(sock, {"run": request}, list(STANDARD_FDS))
            reply, _ = protocol.receive(sock)
        except OSError:
            reply = None
        if reply is None or "pid" not in reply:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
            return  # the server went away before it forked: run here
        code = wait_for(sock, reply["pid"], held)
    end_as(code)


def wait_for(sock: socket.socket, pid: int, held: set) -> int:
    """The run's exit code (negative: the signal that ended it), stop signals relayed to its
    process group meanwhile (those that came while held, first)."""

    def relay(signum, frame):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signum)

    for signum in RELAYED:
        signal.signal(signum, relay)
    signal.pthread_sigmask(signal.SIG_SETMASK, held)
    try:
        message, _ = protocol.receive(sock)
    except OSError:
        message = None
    if message is not None:
        return int(message["exit"])
    # The server ended before the run: stop the run as a killed command's is stopped.
    relay(signal.SIGTERM, None)
    while alive(pid):
        time.sleep(0.1)
    print(
        f"trainer: error: the server ended during the run (pid {pid}); the run was stopped", file=sys.stderr
    )
    return 1


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def end_as(code: int) -> None:
    """Exit with `code`; a run ended by a signal ends this process by the same signal, so that
    a shell sees what it would have seen."""
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code
    sys.stdout.flush()
    os._exit(code)
