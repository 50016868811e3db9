"""One live run per run folder: `run.lock` in the folder names its owner (pid, host, start).

As with Git's `index.lock`, a second run or a resume into a live folder is refused in one
line naming the owner, before it writes anything there. Whether the owner still runs is the
kernel's to say: the owner holds an flock on the file, which ends with its process however
that ends (kill -9 included). A lock file whose flock is free was left by a run that is gone;
the next run takes the folder over and says so. On a file system without flock, a lock naming
a process of this host that has ended is taken over, any other is respected.

The process that starts a run owns the folder: the Hydra job, or a `Trainer(...).fit()`
caller. Under DDP the ranks run inside that ownership (the launcher's, or torchrun's rank 0),
and ranks restarted by the elastic agent resume into the folder their launcher still owns.
No torch here: the command line takes the lock before Hydra writes into the folder.

Must not touch: what the run writes into the folder (trainer/run.py).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

from trainer.atomic import is_alive
from trainer.config import TrainerError
from trainer.torchrun_env import started_by_torchrun

log = logging.getLogger(__name__)

LOCK = "run.lock"


class RunFolderInUse(TrainerError):
    pass


class _Lock:
    def __init__(self, folder: Path, descriptor: int, previous_owner: dict | None):
        self.folder = folder
        self.descriptor = descriptor
        self.previous_owner = previous_owner  # what a stale lock said, until logged
        self.holders = 1


_held: dict[Path, _Lock] = {}  # this process's locks, by folder: taking one again nests


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) shares its parent's flock: it lets go of its copy, so
    that the lock ends with the owner rather than with the last of its children."""
    for lock in _held.values():
        with contextlib.suppress(OSError):
            os.close(lock.descriptor)
    _held.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def describe(owner: dict) -> str:
    since = f" since {owner['since']}" if owner.get("since") else ""
    return f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')}{since}"


def read_owner(descriptor: int) -> dict:
    os.lseek(descriptor, 0, os.SEEK_SET)
    text = os.read(descriptor, 4096).decode(errors="replace")
    try:
        owner = json.loads(text)
    except ValueError:
        return {}
    return owner if isinstance(owner, dict) else {}


def _flock(descriptor: int, owner: dict) -> bool:
    """Take the flock; False where another process holds it. Without flock support, judge the
    named owner: a process of this host that has ended is gone, anything else may run."""
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as error:
        if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
    pid = owner.get("pid")
    return not owner or (
        owner.get("host") == socket.gethostname() and isinstance(pid, int) and not is_alive(pid)
    )


def _open(path: Path) -> int:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise TrainerError(
            f"cannot take the run folder {path.parent} ({error.strerror or error}): "
            "set hydra.run.dir=/a/writable/folder"
        ) from None


def _acquire(folder: Path) -> _Lock:
    path = folder / LOCK
    while True:
        descriptor = _open(path)
        owner = read_owner(descriptor)
        if not _flock(descriptor, owner):
            os.close(descriptor)
            named = f"{describe(owner)} ({path})" if owner else f"another process ({path})"
            raise RunFolderInUse(
                f"run folder {folder} is in use by {named}: wait for that run to end, or give this one "
                f"a folder of its own (hydra.run.dir=/another/folder)"
            )
        # The previous owner removes the file before it lets go: ours may no longer be the one there.
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(descriptor), os.stat(path)):
                break
        os.close(descriptor)
    owner = read_owner(descriptor)  # what the file says now that no live process holds it
    mine = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": datetime.now().isoformat(" ", "seconds"),
    }
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, (json.dumps(mine) + "\n").encode(), 0)
    return _Lock(folder, descriptor, owner or None)


def _release(lock: _Lock) -> None:
    # Removed while still held, so that a process waiting on this file sees it is no longer there.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(lock.folder / LOCK)
    os.close(lock.descriptor)


def acquire(folder: str | Path) -> None:
    """Own `folder` (RunFolderInUse when a live run does); again from this process, nest."""
    key = Path(folder).resolve()
    if key in _held:
        _held[key].holders += 1
    else:
        _held[key] = _acquire(key)


def release(folder: str | Path) -> None:
    key = Path(folder).resolve()
    lock = _held[key]
    lock.holders -= 1
    if lock.holders == 0:
        del _held[key]
        _release(lock)


def report_takeover(folder: str | Path) -> None:
    """Log, once, that `folder`'s lock had been left by a run that is gone (logging is set up
    only once Hydra runs the job, after the command line took the lock)."""
    lock = _held.get(Path(folder).resolve())
    if lock is not None and lock.previous_owner is not None:
        log.warning(
            "run folder %s was left locked by %s, which has ended: this run takes it over",
            lock.folder,
            describe(lock.previous_owner),
        )
        lock.previous_owner = None


def starts_runs() -> bool:
    """Under torchrun every rank runs the command line; rank 0 owns the folder for them all."""
    return not started_by_torchrun() or os.environ.get("RANK") == "0"


@contextlib.contextmanager
def owned(folder: str | Path) -> Iterator[None]:
    """While inside, this process owns `folder` (a torchrun rank other than 0 runs in rank 0's
    ownership)."""
    if not starts_runs():
        yield
        return
    acquire(folder)
    try:
        report_takeover(folder)
        yield
    finally:
        release(folder)
