"""A checkpoint's bytes: torch.save's zip, made in memory, without the zip's CRC-32s.

torch.load never checks those checksums (a flipped byte of a tensor loads as it is, tried on
torch 2.14), and computing them was 40% of serializing a ResNet-18 checkpoint (134 MB of weights
and optimizer state): 175 against 100 ms on the 2-core CPU host. A run serializes on its
training thread at each epoch's end, with the GPU idle: a ResNet-18 run's 14 checkpoints held it
for 1.5 s on an H100 host, 1.26 s of it in torch's zip writer (py-spy, recipe=resnet18_94,
README "From Enter to result"). The atomic write (trainer/atomic.py) is what keeps a checkpoint
whole.

Serializing on the checkpoint's writer thread instead, from a copy made on the GPU, took the
GPU's idle time away but cost the training more: 64k against 74.5k ResNet-18 images/s on one
H100 (the writer's Python work holding the interpreter's lock while the training thread queued
steps), the time to 94% 10.0-10.2 s against 8.8 s. So the state is serialized where the save is
called, as of the call.

Owns: how a checkpoint's state becomes bytes. Must not touch: what it holds and where it goes
(trainer/checkpoint.py).
"""

from __future__ import annotations

import contextlib
import io


def without_zip_checksum() -> contextlib.AbstractContextManager:
    try:
        from torch.utils.serialization import config  # torch 2.6 and later
    except ImportError:
        return contextlib.nullcontext()
    return config.patch("save.compute_crc32", False)


def serialized(obj: object) -> memoryview:
    """torch.save's bytes, made in memory: torch's own file writer reports a full disk or a
    file-size limit only as "enforce fail at inline_container.cc", a plain write says which it was."""
    import torch

    buffer = io.BytesIO()
    with without_zip_checksum():
        torch.save(obj, buffer)
    return buffer.getbuffer()
