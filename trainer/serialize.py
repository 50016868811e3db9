"""A checkpoint's bytes: torch.save's zip, without the zip's CRC-32s, as a list of buffers whose
large parts are the snapshot's own memory, not copies of it.

torch.load never checks those checksums (a flipped byte of a tensor loads as it is, tried on
torch 2.14), and computing them was 40% of serializing a ResNet-18 checkpoint (134 MB of weights
and optimizer state): 175 against 100 ms on the 2-core CPU host. The atomic write
(trainer/atomic.py) is what keeps a checkpoint whole.

torch.save's Python work (pickling the state, one zip record per storage) runs on the caller's
thread, where it reads no tensor's bytes: each storage's bytes are handed to `write` as a view of
the snapshot's host memory (trainer/snapshot.py), and kept as that view. The writer's thread
then waits for the snapshot's copies and writes the views out, its Python's lock let go in each
write: on one H200, `perf=fast` ran 84,572 images/s (84,403-84,631) in 3-epoch runs against
83,331 (83,146-83,876) the way below (3 runs each, taking turns; README "From Enter to
result"). Serialized whole on the writer's thread instead, into memory kept for it, the writer's
Python work shared the interpreter's lock with the training thread while the next epoch
trained: `perf=fast` lost 2% of its images/s in 3-epoch runs on one H200 (82,994 against
84,858, README "From Enter to result"). Serialized whole on the training thread, with the GPU
idle, a ResNet-18 run's 14 checkpoints had held it for 0.7-1.5 s.

Owns: how a checkpoint's state becomes bytes. Must not touch: what it holds and where it goes
(trainer/checkpoint.py), the copy of the state (trainer/snapshot.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable


def without_zip_checksum() -> contextlib.AbstractContextManager | None:
    """torch.save's CRC-32s switched off while in it; None where torch has no such switch
    (before 2.6): its writer then reads every storage's bytes as it writes its record."""
    try:
        from torch.utils.serialization import config  # torch 2.6 and later
    except ImportError:
        return None
    return config.patch("save.compute_crc32", False)


def serialized(state: object, kept: dict[int, int], copied: Callable[[], None]) -> list:
    """torch.save's bytes of `state` as buffers, in order: each write of one of the memory
    blocks in `kept` (address -> bytes: the snapshot's host storages, which outlive the write,
    their bytes still being copied until `copied` returns) kept as a view of it, unread;
    everything else (the pickle, the zip's records, storages not in `kept`) copied as it comes.
    Where torch's writer did not hand over each block whole, in one write, it may have read one
    early: then after `copied`, the whole is made again from the copied bytes. The file is
    torch.save's, but for one field torch.load does not read: torch's writer looks at the first
    bytes of each write for a zip marker to build `.data/serialization_id`, and reads a kept
    block's before its copy has landed."""
    import torch

    switch = without_zip_checksum()
    if switch is None:  # its checksums read the bytes: only once they are copied
        copied()
        switch = contextlib.nullcontext()
    parts = Parts(kept)
    with switch:
        torch.save(state, parts)
    if parts.viewed != set(kept):
        copied()
        parts = Parts({})
        with without_zip_checksum() or contextlib.nullcontext():
            torch.save(state, parts)
    return parts.done()


class Parts:
    """The file-like torch.save writes into (`serialized`)."""

    def __init__(self, kept: dict[int, int]) -> None:
        self.kept = kept
        self.viewed: set[int] = set()  # the blocks of `kept` met whole, as one write each
        self.parts: list = []
        self.small = bytearray()  # the copied writes since the last view, joined

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        start = address(view) if view.nbytes else None
        if start in self.kept and self.kept[start] == view.nbytes:
            self._close_small()
            self.parts.append(view)
            self.viewed.add(start)
        else:
            self.small += view
        return view.nbytes

    def flush(self) -> None:
        """torch.save flushes its file when done: nothing is held back here."""

    def done(self) -> list:
        self._close_small()
        return self.parts

    def _close_small(self) -> None:
        if self.small:
            self.parts.append(bytes(self.small))
            self.small = bytearray()


def address(view: memoryview) -> int:
    """Where a buffer's bytes are (read-only ones too, as torch's writer hands them)."""
    import numpy as np

    return np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0]
