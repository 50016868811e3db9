"""Python's garbage collector over a command's life.

A run's process makes most of its objects once, while it imports (Hydra, torch, dynamo,
inductor, torchvision: about 440,000 objects the collector tracks). Each of the collector's full
collections scans every tracked object, and the imports themselves set off several: on the
2-core CPU host (torch 2.14.1) a CPU run with compile=true spent 0.74 s of its 7.7 s in 7 full
collections, all before its warm-up, which freed almost nothing. A process forked from one that
imported all that (a served command, a parallel sweep's worker, a tuner trial, a DDP rank)
scanned the inherited objects at its first full collection, writing to each one's memory page
and so copying it from the parent: its first composition of the config took 0.36-0.38 s against
0.12-0.13 s with them frozen.

So the collector is paused while the process imports, and what the imports made is then frozen
(moved where the collector no longer scans it) before collection resumes: the command line's
modules before its checks (`pause` at the start, `freeze_and_resume` before the checks), torch
and the trainer before the first run's set-up (`imports`, around the run's). The checks run with
the collector on: each composition of the config leaves about 1 MB in reference cycles, which a
64-job sweep's checks would otherwise freeze for the process's life. Once a run has begun in the
process, nothing more is frozen: an earlier job's model and graphs, in reference cycles, must
stay where the collector frees them. A forked process freezes what it inherited at once
(`os.register_at_fork`).

Owns: when the collector pauses and what it stops scanning. Must not touch: anything else.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator

from trainer import timing


def pause() -> None:
    """Before imports: no collection until `freeze_and_resume`."""
    gc.disable()


def freeze_and_resume() -> None:
    """After imports: everything alive frozen, unless a run has begun in this process (its
    objects are a job's, not imports'); the collector on again in any case."""
    if timing.runs_started() == 0:
        gc.freeze()
    gc.enable()


@contextlib.contextmanager
def imports() -> Iterator[None]:
    """`pause` for the block's imports, then `freeze_and_resume`, even when an import fails."""
    pause()
    try:
        yield
    finally:
        freeze_and_resume()


os.register_at_fork(after_in_child=gc.freeze)
