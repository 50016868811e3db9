"""The server: imports what every run imports, then, for each command a client hands over
(trainer/serve/client.py), forks a process that runs it (trainer/serve/child.py) and tells the
client how that process ended.

It is the forkserver's idea (trainer/forkserver.py: the same preload, CUDA left alone so that
each forked process starts its own) for commands typed at a shell rather than for processes a
run starts. multiprocessing's forkserver cannot be it: it belongs to the process that started
it and ends with it, and it hands its children no terminal. So the loop below is by hand: one
thread (a process forked from a threaded one may inherit a held lock), a selector over the
socket and the clients, SIGCHLD through a wakeup descriptor.

A run whose client went away (its command killed outright, its terminal closed) gets SIGTERM,
which stops it at a step with its checkpoint saved, as a stopped run. A server asked to stop
takes no new command and ends after its running ones, reporting each.

Owns: the socket, the preload, the forks and their exits. Must not touch: what a run does.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import selectors
import signal
import socket
import sys
import time
import traceback
import warnings
from pathlib import Path

from trainer.serve import protocol

REQUEST_TIMEOUT_S = 10.0  # a client sends its request at once; one that does not is dropped
STALE_CHECK_S = 30.0  # how often the server checks that its code and packages are as it imported them
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD)


class Server:
    def __init__(self, path: Path, idle_s: float | None, environ: dict[str, str]):
        self.path = path
        self.idle_s = idle_s
        self.environ = environ  # as the server started: its key is worked out from it
        self.children: dict[int, socket.socket] = {}  # a run's pid -> its client
        self.stopping = False
        self.served = 0
        self.selector = selectors.DefaultSelector()
        self.listener = listen(path)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)

    def run(self) -> None:
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector through wake_w
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, lambda *_: self.stop())
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "wake")
        idle_since = stale_checked = time.monotonic()
        while not (self.stopping and not self.children):
            now = time.monotonic()
            if self.idle_s is not None and not self.children and now - idle_since >= self.idle_s:
                print(f"trainer.serve: idle for {self.idle_s / 60:g} min: stopped", flush=True)
                self.stop()
                continue
            if now - stale_checked >= STALE_CHECK_S:  # when due, not per command: 110 files' stats
                stale_checked = now
                if not self.stopping and self.stale():
                    print(
                        "trainer.serve: the code or the packages changed: stopped (start it again)",
                        flush=True,
                    )
                    self.stop()
                    continue
            timeout = STALE_CHECK_S - (now - stale_checked)
            if self.idle_s is not None and not self.children:
                timeout = min(timeout, self.idle_s - (now - idle_since))
            for key, _ in self.selector.select(timeout):
                if key.data == "accept":
                    self.accept()
                elif key.data == "wake":
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.wake_r, 512)
                    self.reap()
                else:
                    self.client_gone(key.data)
            if self.children:
                idle_since = time.monotonic()
        self.close()

    def stale(self) -> bool:
        """Whether the code or packages changed since the server imported them (its key moved)."""
        return protocol.socket_path(protocol.environment_key(self.environ)) != self.path

    def accept(self) -> None:
        """One client's message: a command to run, or a stop or status request. Whatever it
        sends, the server goes on (a message it cannot read is dropped with its descriptors)."""
        try:
            conn, _ = self.listener.accept()
        except OSError:  # none waiting after all, or the listener closed by a stop meanwhile
            return
        fds: list[int] = []
        try:
            conn.settimeout(REQUEST_TIMEOUT_S)
            if protocol.peer_uid(conn) != os.getuid():
                raise PermissionError("another user's command")
            message, fds = protocol.receive(conn, max_fds=3)
            if isinstance(message, dict) and "run" in message and len(fds) == 3 and not self.stopping:
                self.fork(conn, message["run"], fds)
                fds, conn = [], None  # the run's now
                return
            if isinstance(message, dict) and "stop" in message:
                self.stop()
            protocol.send(conn, self.status())
        except Exception as error:  # noqa: BLE001 - one bad client must not end every served run
            print(f"trainer.serve: a client's message dropped: {error!r}", file=sys.stderr, flush=True)
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            if conn is not None:
                conn.close()

    def status(self) -> dict:
        return {"pid": os.getpid(), "running": len(self.children), "served": self.served}

    def fork(self, conn: socket.socket, request: dict, fds: list[int]) -> None:
        own = [self.listener.fileno(), self.wake_r, self.wake_w, self.selector.fileno(), conn.fileno()]
        own += [client.fileno() for client in self.children.values()]
        # Held across the fork: a stop signal for the run (relayed by its client) waits until the
        # run has its own handlers, rather than running the server's in the child.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        with warnings.catch_warnings():  # 3.12's "multi-threaded fork": torch's own threads
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            try:
                from trainer.serve import child

                child.run(request, fds, own)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(70)
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        for fd in fds:
            os.close(fd)
        self.served += 1
        self.children[pid] = conn
        try:
            protocol.send(conn, {"pid": pid})
        except OSError:
            self.client_gone(pid)
            return
        conn.setblocking(False)
        self.selector.register(conn, selectors.EVENT_READ, pid)

    def client_gone(self, pid: int) -> None:
        """The client closed its end before the run ended (killed, its terminal closed)."""
        conn = self.children.get(pid)
        if conn is None:
            return
        try:
            data = conn.recv(1)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            return  # a client sends nothing after its request: not its end
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(conn)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGTERM)

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(conn)
            with contextlib.suppress(OSError):
                conn.setblocking(True)
                protocol.send(conn, {"exit": os.waitstatus_to_exitcode(status)})
            conn.close()

    def stop(self) -> None:
        """No new command; the running ones end as they would."""
        if self.stopping:
            return
        self.stopping = True
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(self.listener)
        self.listener.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def close(self) -> None:
        self.stop()
        self.selector.close()
        os.close(self.wake_r)
        os.close(self.wake_w)


def listen(path: Path) -> socket.socket:
    """The socket at `path`, only its owner may connect; a socket left by a killed server is
    replaced, a live one is refused."""
    if path.exists():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # nothing listens: a server killed outright left it
        else:
            probe.close()
            raise FileExistsError(f"a server for this environment runs already: {path}")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.ExitStack() as undo:
        undo.callback(listener.close)
        old_umask = os.umask(0o177)
        try:
            listener.bind(str(path))
        finally:
            os.umask(old_umask)
        listener.listen(16)
        listener.setblocking(False)
        undo.pop_all()
    return listener


# Beside the forkserver's preload: what a run reads its data with, and a parallel sweep's pool
# (hydra/launcher=parallel), which the sweep's process and each of its workers import.
ALSO_PRELOADED = ("numpy", "joblib", "joblib.externals.loky.process_executor")


def preload() -> None:
    """What every run imports, as the forkserver preloads it, and what each built-in model's
    build imports (a served DDP run's ranks are forked from this process only where it holds
    what their server would preload); CUDA left alone."""
    from trainer import forkserver

    for name in forkserver.PRELOAD + forkserver.COMPILING + ALSO_PRELOADED:
        importlib.import_module(name)
    from trainer.models import BUILD_IMPORTS  # imported with the trainer, above

    for name in dict.fromkeys(name for names in BUILD_IMPORTS.values() for name in names):
        importlib.import_module(name)
    import torch

    if torch.cuda.is_initialized():  # a forked run could not use CUDA
        raise RuntimeError("CUDA started during the server's preload: a forked run could not use it")


def ask(path: Path, message: dict) -> dict | None:
    """The answer of the server at `path` to `message` ({"stop": true}: it stops after its runs;
    {"status": true}), or None where none answers."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
        protocol.send(sock, message)
        return protocol.receive(sock)[0]
    except OSError:
        return None
    finally:
        sock.close()
