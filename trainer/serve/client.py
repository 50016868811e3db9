"""`python -m trainer ...` handing its command to a server (trainer/serve/server.py), before it
imports anything but the standard library: where one serves this environment, the command runs
in a process forked from it, with this command's descriptors (the terminal, the pipes, the
files it was redirected to), folder, environment and arguments, and this process waits for it
and ends as it ended. Ctrl-C and the other stop signals sent to this process go on to the run,
and a run whose command was killed outright is stopped as by SIGTERM (its checkpoint saved).

Not handed over: with TRAINER_SERVE=0, under torchrun (whose ranks are its own processes), under
a debugger or profiler (which watch this process), or where no server of this user answers for
this environment (then nothing is printed: the command runs here). Ctrl-C before the run has
started ends the command, and the server stops the run it was forking.

Owns: the hand-over and the wait. Must not touch: anything the command does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time

from trainer.serve import protocol, settings

RELAYED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
STANDARD_FDS = (0, 1, 2)
REPLY_TIMEOUT_S = 30.0  # a server answers at once; one stopped (SIGSTOP, Ctrl-Z) does not


class Stopped(Exception):
    """A stop signal before the run's pid was known."""


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
    from trainer.process_exit import watched

    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ
    return not under_torchrun and not watched()


def connect() -> socket.socket | None:
    """A connection to this user's server of this environment, or None where none answers: the
    folder must be this user's alone, and the process listening this user's."""
    path = protocol.socket_path(protocol.environment_key())
    if not protocol.owned_folder(path.parent) or not hasattr(socket, "SO_PEERCRED"):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
        if protocol.peer_uid(sock) != os.getuid():
            raise PermissionError(path)
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
        "settings": settings.of_this_process(),
    }
    relayed = [signum for signum in RELAYED if signal.getsignal(signum) is not signal.SIG_IGN]

    def stopped(signum, frame):
        raise Stopped(signum)

    for signum in relayed:
        signal.signal(signum, stopped)
    try:
        with sock:
            sock.settimeout(REPLY_TIMEOUT_S)
            try:
                protocol.send(sock, {"run": request}, list(STANDARD_FDS))
                reply, _ = protocol.receive(sock)
            except TimeoutError:
                print(
                    f"trainer: error: the server did not answer in {REPLY_TIMEOUT_S:g} s: is it stopped? "
                    "TRAINER_SERVE=0 runs the command by itself",
                    file=sys.stderr,
                )
                end_as(1)
            except OSError:
                reply = None
            if reply is None or "pid" not in reply:
                for signum in relayed:
                    signal.signal(
                        signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
                    )
                return  # the server went away before it forked: run here
            sock.settimeout(None)
            code = wait_for(sock, reply["pid"], relayed)
    except Stopped as stop:  # the server sees this end close and stops the run it forked
        end_as(-stop.args[0])
    end_as(code)


def wait_for(sock: socket.socket, pid: int, relayed: list[int]) -> int:
    """The run's exit code (negative: the signal that ended it), stop signals relayed to its
    process group meanwhile (to the process itself while it has not made its group yet: it holds
    them until it has its handlers)."""

    def relay(signum, frame):
        try:
            os.killpg(pid, signum)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.kill(pid, signum)
        except OSError:
            pass

    for signum in relayed:
        signal.signal(signum, relay)
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
    """Whether the process runs (a zombie no longer does: its reaper may be slow, or none)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return "\nState:\tZ" not in status.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True


def end_as(code: int) -> None:
    """Exit with `code`; a run ended by a signal ends this process by the same signal, so that
    a shell sees what it would have seen."""
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
        code = 128 - code
    sys.stdout.flush()
    os._exit(code)
