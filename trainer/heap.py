"""Python's garbage collector over a command's life.

A run's process makes most of its objects once, at its start: the imports (Hydra, torch, dynamo,
inductor, torchvision: about 440,000 objects the collector tracks) and the configs it composes.
Each of the collector's full collections scans every tracked object, and the imports themselves
set off several: on the 2-core CPU host (torch 2.14.1) a CPU run with compile=true spent 0.74 s of
its 7.7 s in 7 full collections, all before its warm-up, which freed almost nothing.
A process forked from one that imported all that (a served command, a parallel sweep's worker, a
tuner trial, a DDP rank) scanned the inherited objects at its first full collection, writing to
each one's memory page and so copying it from the parent: its first composition of the config
took 0.36-0.38 s against 0.12-0.13 s with them frozen.

So:
  - a command's process collects nothing while it imports and checks its command line
    (`pause_for_imports`);
  - before its first run's set-up, what it holds then is frozen (moved where the collector no
    longer scans it), and collection resumes (`freeze_imports`); a later job of a sweep run in
    the same process freezes nothing: an earlier job's model and graphs, freed as its own garbage,
    may sit in reference cycles that only the collector can break;
  - a forked process freezes what it inherited at once (`os.register_at_fork`).
Frozen objects that become garbage in a cycle are never freed; for imports and one command's
composed configs that is a few objects, against a scan of the whole heap at every full collection.

Owns: when the collector pauses and what it stops scanning. Must not touch: anything else.
"""

from __future__ import annotations

import gc
import os

_frozen_here = False  # this process froze its imports before its first run


def pause_for_imports() -> None:
    """At a command's start, before its imports: no collection until `freeze_imports`."""
    gc.disable()


def freeze_imports() -> None:
    """Before a run's set-up: the first time in this process, everything alive is frozen; the
    collector is on again in any case."""
    global _frozen_here
    if not _frozen_here:
        gc.freeze()
        _frozen_here = True
    gc.enable()


os.register_at_fork(after_in_child=gc.freeze)
