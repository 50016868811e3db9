"""A checkpoint's bytes: torch.save's zip, made in memory kept from one checkpoint to the next,
without the zip's CRC-32s.

torch.load never checks those checksums (a flipped byte of a tensor loads as it is, tried on
torch 2.14), and computing them was 40% of serializing a ResNet-18 checkpoint (134 MB of weights
and optimizer state): 175 against 100 ms on the 2-core CPU host. A run serializes on its
training thread at each epoch's end, with the GPU idle: a ResNet-18 run's 14 checkpoints held it
for 1.5 s on an H100 host, 1.26 s of it in torch's zip writer (py-spy, recipe=resnet18_94,
README "From Enter to result"). The atomic write (trainer/atomic.py) is what keeps a checkpoint
whole.

The state is serialized on the checkpoint's writer thread, from a snapshot in host memory
(trainer/snapshot.py). A first try, serializing there from a copy made on the GPU, cost the
training more than it saved: 64k against 74.5k ResNet-18 images/s on one H100, the time to 94%
10.0-10.2 s against 8.8 s (the writer copying from the GPU one storage at a time, and its
Python work holding the interpreter's lock while the training thread queued steps). Here the
writer touches no GPU, and copies its large writes with the lock let go.

Owns: how a checkpoint's state becomes bytes, and the memory they are made in. Must not touch:
what it holds and where it goes (trainer/checkpoint.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


def without_zip_checksum() -> contextlib.AbstractContextManager:
    try:
        from torch.utils.serialization import config  # torch 2.6 and later
    except ImportError:
        return contextlib.nullcontext()
    return config.patch("save.compute_crc32", False)


class CheckpointBuffer:
    """The memory torch.save writes a run's checkpoints into, kept from one checkpoint to the
    next (file-like: torch.save calls `write`). A fresh io.BytesIO per checkpoint spent most of
    its time faulting in new pages and copying as it grew: 88-99 ms per ResNet-18 checkpoint on
    the 2-core CPU, against 28-30 ms into memory kept from the checkpoint before. The first is
    sized from the state's tensors, so that it is one allocation too.

    serialized() hands out a view of the memory; the next call writes over it, so the view must
    be written out first (checkpoint.Saver waits for its last write before serializing again)."""

    def __init__(self) -> None:
        self.memory = bytearray()
        self.size = 0

    def serialized(self, state: dict) -> memoryview:
        """torch.save's bytes, made in memory: torch's own file writer reports a full disk or a
        file-size limit only as "enforce fail at inline_container.cc", a plain write says which
        it was."""
        import torch

        expected = storage_bytes(state)
        if len(self.memory) < expected:
            self.memory = bytearray(expected + expected // 64 + (1 << 20))  # + pickle and zip records
        self.size = 0
        with without_zip_checksum():
            torch.save(state, self)
        return memoryview(self.memory)[: self.size]

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        end = self.size + view.nbytes
        if end > len(self.memory):  # more than expected: grow, keeping what is written
            grown = bytearray(max(end, len(self.memory) * 3 // 2))
            grown[: self.size] = memoryview(self.memory)[: self.size]
            self.memory = grown
        if view.nbytes >= LARGE_WRITE:
            copy_without_the_lock(memoryview(self.memory)[self.size : end], view)
        else:
            self.memory[self.size : end] = view
        self.size = end
        return view.nbytes

    def flush(self) -> None:
        """torch.save flushes its file when done; this memory has nothing to flush."""


# Writes this large (a storage's bytes) are copied by numpy, which lets go of Python's lock while
# it copies: a slice assignment holds it throughout, and the training thread waits
# (checkpoint.Saver serializes on its writer's thread while the next epoch trains). 134 MB in
# 9.4 MB writes from a thread, the 2-core CPU: a Python loop on the main thread ran at 0.9 of its
# speed beside numpy's copies (83 ms), at 0.3-0.4 beside slice assignments (15 ms).
LARGE_WRITE = 1 << 16


def copy_without_the_lock(target: memoryview, source: memoryview) -> None:
    import numpy as np

    np.frombuffer(target, dtype=np.uint8)[:] = np.frombuffer(source, dtype=np.uint8)


def storage_bytes(state: object) -> int:
    """The bytes of the storages under the state's tensors, each storage once (as torch.save
    writes them: tied weights and views share one)."""
    storages = (tensor.untyped_storage() for tensor in tensors_in(state))
    return sum({storage.data_ptr(): storage.nbytes() for storage in storages}.values())


def tensors_in(state: object) -> Iterator:
    """Every tensor in nested dicts, lists and tuples."""
    import torch

    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from tensors_in(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from tensors_in(value)
