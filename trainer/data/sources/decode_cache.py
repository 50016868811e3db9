"""The decode cache (data.decode_cache): class folders' decoded images kept beside the data,
so that the next run reads them instead of decoding every file again.

Must not touch: decoding (trainer/data/sources/imagefolder.py), which decides when to read and
write it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import zlib
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

CACHE_FOLDER = ".trainer-cache"

# The decode cache: one file per split and fingerprint, a JSON header line then the pixels:
#   {"format": "trainer-decode-cache/1", "shape": [N, 3, 32, 32], "dtype": "uint8", "crc32": C}\n
#   then N*3*32*32 bytes, C-ordered
# The fingerprint in its name says which files it was decoded from; the header's shape and
# checksum say whether what it holds is still what was written. zlib.crc32 over a CIFAR-10-sized
# array (50,000 x 3 x 32 x 32 uint8, 153.6 MB) takes 43 ms on the 2-core development machine
# idle, 70 ms with both cores busy (blake2b over 16 MB chunks: 200 ms); reading the file takes
# 60 ms, decoding 50,000 PNGs on those 2 cores 21 s. The checksum also makes a write torn by a crash
# (no fsync) harmless: it fails the check and is decoded again.
CACHE_FORMAT = "trainer-decode-cache/1"
CACHE_SUFFIX = ".pixels"
CACHE_HEADER_BYTES = 1024  # a header line longer than this is not one of ours


def pixel_checksum(pixels: np.ndarray) -> int:
    return zlib.crc32(memoryview(np.ascontiguousarray(pixels)).cast("B"))


def read_cache(path: Path, shape: tuple[int, ...]) -> torch.Tensor | None:
    """The decoded images kept at `path`, when they are exactly what was written: the expected
    shape and pixels that match their checksum. Otherwise None, after one log line saying why
    (absent is not worth a line): the caller decodes again and replaces the file."""
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as handle:
            header = json.loads(handle.readline(CACHE_HEADER_BYTES))
            problem = cache_header_problem(header, shape)
            start = handle.tell()
            if problem is None and os.fstat(handle.fileno()).st_size - start != math.prod(shape):
                problem = "holds a different number of bytes than its header says"
            elif problem is None:
                # Mapped, not read: the pages are the page cache's own, where reading them
                # filled 153 MB of fresh memory first (0.34 s against 0.04 s, read and
                # checksum, CIFAR-10's train split on the 2-core CPU). Copy-on-write: nothing
                # reaches the file, and a writer replaces it (write_cache), never changes it.
                pixels = np.memmap(handle, dtype=np.uint8, mode="c", offset=start, shape=shape)
                if pixel_checksum(pixels) != header["crc32"]:
                    problem = "holds pixels that do not match their checksum (changed since written)"
    except (OSError, ValueError) as error:  # ValueError: not JSON, not UTF-8
        problem = f"cannot be read as a decode cache ({str(error).splitlines()[0] or type(error).__name__})"
    if problem is None:
        return torch.from_numpy(pixels)
    log.warning("decode cache %s %s: decoding the images again", path, problem)
    return None


def cache_header_problem(header: object, shape: tuple[int, ...]) -> str | None:
    if not isinstance(header, dict) or header.get("format") != CACHE_FORMAT:
        return f"is not a {CACHE_FORMAT} file"
    if header.get("shape") != list(shape) or header.get("dtype") != "uint8":
        return f"holds {header.get('dtype')} images of shape {header.get('shape')}, not uint8 {list(shape)}"
    if not isinstance(header.get("crc32"), int):
        return "has no checksum"
    return None


def write_cache(path: Path, images: torch.Tensor) -> None:
    """Atomic: a reader sees a whole file or none. Each writer has a temporary file of its own
    in the same folder, so two runs decoding at once each replace the file with a whole one
    (the same pixels). A folder we cannot write to only costs the next run its decoding."""
    pixels = np.ascontiguousarray(images.numpy())
    header = {"format": CACHE_FORMAT, "shape": list(pixels.shape), "dtype": "uint8"}
    header["crc32"] = pixel_checksum(pixels)
    temporary = None
    try:
        path.parent.mkdir(exist_ok=True)
        with tempfile.NamedTemporaryFile(
            "wb", dir=path.parent, prefix=f"{path.name}.", suffix=".tmp", delete=False
        ) as handle:
            temporary = Path(handle.name)
            handle.write(json.dumps(header).encode() + b"\n")
            handle.write(memoryview(pixels).cast("B"))
        os.replace(temporary, path)
        log.info("decoded images kept in %s for the next run", path)
    except OSError as error:
        if temporary is not None:
            temporary.unlink(missing_ok=True)
        log.warning("could not keep the decoded images in %s (%s); the next run decodes again", path, error)
