"""Processes under a process, read from /proc, and their end by SIGKILL: what the tuner's trials,
inductor's compile-worker pools and a parallel sweep's workers leave under them. By hand: the
standard library has no walk of the process tree, and psutil, which has one, is not among the
dependencies.

Owns: reading the tree and killing a list of processes. Must not touch: which processes to end
and when (the callers).
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path


def descendants(*pids: int) -> list[int]:
    """Every process under the pids (their children, theirs, ...), from one read of /proc; []
    without it."""
    children: dict[int, list[int]] = {}
    proc = Path("/proc")
    for entry in proc.iterdir() if proc.is_dir() else []:
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # ended while we looked
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], list(pids)
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def kill(pids: list[int]) -> None:
    """SIGKILL to each of `pids`; one already gone is passed over."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
