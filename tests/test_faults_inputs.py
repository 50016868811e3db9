"""Faults in what a user hands the trainer, as tables: a decode cache damaged on disk, a
model.target whose code fails or does not fit, settings that cannot act or make no sense.
Each is answered in one line naming what is wrong: never used silently, never a traceback.
(The run-folder faults live in test_faults.py.)"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compose_config
from PIL import Image

from trainer.config import to_train_config
from trainer.data import load_source
from trainer.data.sources import CACHE_FOLDER, read_cache, write_cache

# ---------------------------------------------------------------- the decode cache (R5)


@pytest.fixture
def image_folder(tmp_path):
    """train/ and test/ class folders of a few small PNGs."""
    random = np.random.default_rng(0)
    for split, count in (("train", 4), ("test", 2)):
        for name in ("cat", "dog", "ship"):
            folder = tmp_path / "images" / split / name
            folder.mkdir(parents=True)
            for index in range(count):
                Image.fromarray(random.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(
                    folder / f"{index}.png"
                )
    return tmp_path / "images"


def cached_data(root: Path):
    return to_train_config(
        compose_config("data=imagefolder", f"data.root={root}", "data.decode=once", "data.decode_cache=true")
    ).data


def cache_file(root: Path, split: str) -> Path:
    [path] = [path for path in (root / CACHE_FOLDER).glob(f"{split}-*") if not path.name.endswith(".tmp")]
    return path


def edit_one_pixel(path: Path, images: torch.Tensor) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the last byte of either layout is a pixel
    path.write_bytes(bytes(data))


def zero_the_pixels(path: Path, images: torch.Tensor) -> None:
    data = bytearray(path.read_bytes())
    data[-images.numel() :] = bytes(images.numel())
    path.write_bytes(bytes(data))


def replace_with_saved_zeros(path: Path, images: torch.Tensor) -> None:
    with open(path, "wb") as handle:
        np.save(handle, np.zeros_like(images.numpy()))


def keep_channels_last(path: Path, images: torch.Tensor) -> None:
    write_cache(path, images.permute(0, 2, 3, 1).contiguous())  # a whole, checksummed file


def cut_in_half(path: Path, images: torch.Tensor) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@dataclass
class CacheFault:
    split: str
    damage: Callable[[Path, torch.Tensor], None]
    problem: str  # what the log line says of the file


CACHE_FAULTS = {
    "train-pixel-edited": CacheFault(
        "train", edit_one_pixel, "holds pixels that do not match their checksum (changed since written)"
    ),
    "test-zeroed-in-place": CacheFault(
        "test", zero_the_pixels, "holds pixels that do not match their checksum (changed since written)"
    ),
    "test-replaced-by-saved-zeros": CacheFault(
        "test",
        replace_with_saved_zeros,
        "cannot be read as a decode cache ('utf-8' codec can't decode byte 0x93 in position 0: "
        "invalid start byte)",
    ),
    "train-wrong-shape": CacheFault(
        "train", keep_channels_last, "holds uint8 images of shape [12, 32, 32, 3], not uint8 [12, 3, 32, 32]"
    ),
    "train-truncated": CacheFault(
        "train", cut_in_half, "holds a different number of bytes than its header says"
    ),
}


@pytest.mark.parametrize("fault", CACHE_FAULTS.values(), ids=CACHE_FAULTS.keys())
def test_a_damaged_decode_cache_is_one_line_and_a_fresh_decode(image_folder, caplog, fault):
    caplog.set_level(logging.INFO)
    cfg = cached_data(image_folder)
    decoded = getattr(load_source(cfg, seed=0), fault.split).images
    cache = cache_file(image_folder, fault.split)
    fault.damage(cache, decoded)

    caplog.clear()
    after_damage = load_source(cfg, seed=0)
    warnings = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    caplog.clear()
    next_run = load_source(cfg, seed=0)

    assert warnings == [f"decode cache {cache} {fault.problem}: decoding the images again"]
    assert torch.equal(getattr(after_damage, fault.split).images, decoded)
    assert torch.equal(getattr(next_run, fault.split).images, decoded)  # the file was made whole again
    assert f"read {len(decoded)} decoded images" in caplog.text
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING]


def test_two_runs_keeping_the_same_cache_at_once_leave_only_whole_files(tmp_path, caplog):
    images = torch.randint(0, 256, (300, 3, 32, 32), dtype=torch.uint8)
    path = tmp_path / CACHE_FOLDER / "train-0123456789abcdef.pixels"

    def keep() -> None:
        for _ in range(10):
            write_cache(path, images)

    writers = [threading.Thread(target=keep) for _ in range(2)]
    for writer in writers:
        writer.start()
    reads = []
    while any(writer.is_alive() for writer in writers):
        reads.append(read_cache(path, tuple(images.shape)))
    for writer in writers:
        writer.join()

    assert not [record for record in caplog.records if record.levelno >= logging.WARNING]
    assert all(read is None or torch.equal(read, images) for read in reads)
    assert torch.equal(read_cache(path, tuple(images.shape)), images)
    assert [file.name for file in path.parent.iterdir()] == [path.name]
