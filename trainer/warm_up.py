"""The warm-up: the first training steps at each image size the run trains at, and the
evaluation's first run, before the clock starts, then every state they changed put back. A
first run of some settings compiles there from scratch; a later one reads torch's caches, and
cuDNN times its algorithms; so time to target counts none of it, and compile_s all of it.

    progress.compile_s += warm_up(parts, progress.epoch)

Owns: what the warm-up runs and what it puts back. Must not touch: the step itself
(trainer/loop.py, whose functions it calls as the loop does), whether there is a warm-up
(parts.warm_up_steps, decided in trainer/perf/backend.py).
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
from collections.abc import Iterable

from trainer import loop
from trainer.console import still_running
from trainer.parts import Batch, Parts

log = logging.getLogger(__name__)


def warm_up(parts: Parts, epoch: int) -> float:
    """Compile and autotune on the first training batches and the evaluation's batch shapes
    before the clock starts, then put back every state those steps changed; returns their
    seconds (compile_s)."""
    if not parts.warm_up_steps:
        return 0.0
    started = time.perf_counter()
    log.info(
        "warm-up: %d steps per image size and the evaluation's first and last batch before the "
        "clock starts (%s); a first run of these settings compiles from scratch, a later one "
        "reads torch's caches",
        parts.warm_up_steps,
        parts.warm_up_work,
    )
    with still_running("warm-up"):
        parts.cache_keys_ready()
        warm_up_steps(parts, epoch)
    seconds = time.perf_counter() - started
    log.info("warm-up: %d steps compiled and autotuned in %.1f s (compile_s)", parts.warm_up_steps, seconds)
    return seconds


def warm_up_steps(parts: Parts, epoch: int) -> None:
    changed = {"model": parts.raw_model, "optimizer": parts.optimizer}
    if parts.scaler.is_enabled():
        changed["scaler"] = parts.scaler
    saved = {name: copy.deepcopy(part.state_dict()) for name, part in changed.items()}
    parts.model.train()
    # each image size the run will train at: the low-res epochs' and the full size after them
    shapes = [epoch] + ([parts.low_res_epochs] if epoch < parts.low_res_epochs < parts.epochs else [])
    for first_epoch in shapes:
        parts.train_loader.set_epoch(first_epoch)
        for images, labels in itertools.islice(parts.train_batches, parts.warm_up_steps):
            loop.forward_backward(parts, images, labels, 1, boundary=True)
            parts.autotuned()  # before torch.compile's CUDA graphs record, at the second step
            loop.apply_gradients(parts)
    for name, part in changed.items():
        part.load_state_dict(saved[name])
    # the evaluation's first run (its kernels' first loads) outside time to target: the model runs
    # on the first and the last batch, the two shapes it runs at; on the others it would only cost
    # its time again (a warm 6-view evaluation of ResNet-18 takes 0.28 s on an H200, README "From
    # Enter to result"). Every batch is still loaded, so a DataLoader's workers end as after a
    # full pass.
    loop.evaluate(parts, first_and_last(parts.test_batches))
    parts.synchronize()


def first_and_last(batches: Iterable[Batch]) -> list[Batch]:
    """The first batch and the last (one batch: itself), each once."""
    first = last = None
    for batch in batches:
        first = batch if first is None else first
        last = batch
    return [] if first is None else [first] if last is first else [first, last]
