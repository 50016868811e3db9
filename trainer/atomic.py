"""Atomic file writes: a reader sees the old file or the new one, never half of one.

Each process writes into a temporary file of its own, `<name>.<host>.<pid>.tmp`, and renames
it over the file once it is whole and on disk. The name says whose it is: another process
(a second run, `python -m trainer.evaluate`, a resume) never takes a live writer's file for
a leftover, and removes one only once the process named in it has ended (a kill -9 midway
leaves one behind). A write that fails (a full disk, `ulimit -f`) removes its temporary
file, keeps the previous file and says why in one line. No torch here: the command-line
check imports this module.

Owns: write_atomic and finding leftovers. Must not touch: what is written or when
(trainer/checkpoint.py, trainer/logging.py, the decode cache decide).
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

from trainer.config import TrainerError

log = logging.getLogger(__name__)

# Where a file could not be written, what frees the way: the run folder's files.
RUN_FOLDER_FIX = (
    "free disk space, raise the file-size limit (ulimit -f), or set hydra.run.dir=/a/folder/with/room"
)


class NotWritten(TrainerError):
    pass


def temporary_path(path: Path) -> Path:
    """This process's temporary file for `path`."""
    return path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")


def write_atomic(path: Path, data: bytes | memoryview | list, what: str, fix: str = RUN_FOLDER_FIX) -> None:
    """`data` (or a list of buffers, one after another) into `path`, all or nothing; NotWritten
    (one line naming `what`, the reason and `fix`) when the disk refuses."""
    temporary = temporary_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(temporary, "wb") as file:
            for part in data if isinstance(data, list) else [data]:
                file.write(part)
            file.flush()
            # Some file systems report a full disk only here (NFS, quotas); a rename before
            # the data is on disk can leave an empty file after a crash.
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except OSError as error:
        temporary.unlink(missing_ok=True)
        raise NotWritten(
            f"could not write {what} {path} ({error.strerror or error}); any earlier {path.name} "
            f"there is kept: {fix}"
        ) from None


def writer(temporary: Path, path: Path) -> tuple[str, int] | None:
    """(host, pid) of the process that writes `temporary` for `path`; None for other names."""
    middle = temporary.name[len(path.name) + 1 : -len(".tmp")]
    host, _, pid = middle.rpartition(".")
    return (host, int(pid)) if host and pid.isdigit() else None


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_leftovers(path: Path) -> list[Path]:
    """Remove the temporary files of `path` whose writer has ended (a save killed midway, a rank
    the launcher stopped amid a write), each said in the log; return them. A file written on
    another host, or by a process still running here, stays: it may be mid-write."""
    removed = []
    host = socket.gethostname()
    for temporary in path.parent.glob(f"{path.name}.*.tmp"):
        owner = writer(temporary, path)
        if owner is None or owner[0] != host or is_alive(owner[1]):
            continue
        try:
            temporary.unlink()
        except OSError:  # cleaned by another process first, or a folder we may only read
            continue
        log.info("removed %s, left by a write of %s whose process ended midway", temporary, path.name)
        removed.append(temporary)
    return removed
