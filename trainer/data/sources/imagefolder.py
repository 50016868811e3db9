"""data=imagefolder: class folders of image files (train/<class>/, test/<class>/), decoded
once, in parallel, when the decoded images fit in memory (data.decode), else per epoch by the
loader; kept for the next run when data.decode_cache is on.

Must not touch: the cache file's format (trainer/data/sources/decode_cache.py), augmentation.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from trainer.config import DataConfig, DataSource, DecodeMode
from trainer.data.augment import IMAGE_SIZE
from trainer.data.sources.decode_cache import CACHE_FOLDER, CACHE_SUFFIX, read_cache, write_cache
from trainer.data.sources.listing import ListingAhead, fingerprint
from trainer.data.sources.splits import CorruptImageError, DatasetNotFoundError, ImageSplit, Splits
from trainer.preflight import imagefolder_missing

log = logging.getLogger(__name__)

MEMORY_SHARE = 0.25  # decode=auto holds decoded images in memory up to this share of what is free
DECODE_CHUNK = 512  # images per decoding task
SPLITS = ("train", "test")


def decode_image(path: str) -> np.ndarray:
    """One image file as (3, 32, 32) uint8: RGB, shorter side resized to 32, center-cropped."""
    try:
        with Image.open(path) as image:
            image = image.convert("RGB")
            if image.size != (IMAGE_SIZE, IMAGE_SIZE):
                scale = IMAGE_SIZE / min(image.size)
                width, height = (max(IMAGE_SIZE, round(side * scale)) for side in image.size)
                image = image.resize((width, height), Image.BILINEAR)
                left, top = (width - IMAGE_SIZE) // 2, (height - IMAGE_SIZE) // 2
                image = image.crop((left, top, left + IMAGE_SIZE, top + IMAGE_SIZE))
            return np.asarray(image).transpose(2, 0, 1).copy()
    except Exception as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CorruptImageError(
            f"cannot decode image {path} ({reason}): remove or replace the file, then run again"
        ) from None


def _decode_files(paths: list[str]) -> np.ndarray:
    return np.stack([decode_image(path) for path in paths])


def decode_all(paths: list[str], processes: int, description: str) -> torch.Tensor:
    """Every file decoded, in order, on `processes` processes, with a progress bar on a terminal."""
    chunks = [paths[start : start + DECODE_CHUNK] for start in range(0, len(paths), DECODE_CHUNK)]
    bar = tqdm(total=len(paths), desc=description, unit="img", disable=None, file=sys.stderr)
    parts = []
    with bar:
        if processes <= 1 or len(chunks) <= 1:
            for chunk in chunks:
                parts.append(_decode_files(chunk))
                bar.update(len(chunk))
        else:
            # fork: the children need only PIL and numpy, and start in milliseconds
            with ProcessPoolExecutor(processes, mp_context=get_context("fork")) as pool:
                for chunk, part in zip(chunks, pool.map(_decode_files, chunks)):
                    parts.append(part)
                    bar.update(len(chunk))
    return torch.from_numpy(np.concatenate(parts))


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def load_image_split(
    folder: Path,
    samples: list[tuple[str, int]],
    cfg: DataConfig,
    in_memory: bool,
    processes: int,
    known_fingerprint: str | None = None,
) -> ImageSplit:
    files = [path for path, _ in samples]
    labels = torch.tensor([label for _, label in samples], dtype=torch.int64)
    if not in_memory:
        return ImageSplit(labels, files=files)
    started = time.perf_counter()
    found = known_fingerprint or fingerprint(str(folder), samples, IMAGE_SIZE)
    cache = folder.parent / CACHE_FOLDER / f"{folder.name}-{found}{CACHE_SUFFIX}"
    shape = (len(labels), 3, IMAGE_SIZE, IMAGE_SIZE)
    images = read_cache(cache, shape) if cfg.decode_cache else None
    if images is not None:
        seconds = time.perf_counter() - started  # the read, its checksum, a fingerprint not begun ahead
        log.info("read %d decoded images of %s from %s in %.2f s", len(images), folder, cache, seconds)
        return ImageSplit(labels, images, files)
    started = time.perf_counter()
    images = decode_all(files, processes, f"decoding {folder.name}")
    log.info(
        "decoded %d images of %s in %.1f s (%d processes)",
        len(images),
        folder,
        time.perf_counter() - started,
        processes,
    )
    if cfg.decode_cache:
        write_cache(cache, images)
    return ImageSplit(labels, images, files)


def begin_listing(cfg: DataConfig) -> ListingAhead | None:
    """data=imagefolder: the splits' listing and fingerprints begun in a helper process
    (listing.py), to run beside the imports of the set-up; None for other sources."""
    if cfg.source is not DataSource.imagefolder:
        return None
    root = str(Path(os.path.expanduser(cfg.root)))
    return ListingAhead(root, SPLITS, IMAGE_SIZE if cfg.decode_cache else None)


def load_imagefolder(cfg: DataConfig, processes: int, listing: ListingAhead | None = None) -> Splits:
    root = Path(os.path.expanduser(cfg.root))
    found = listing.result() if listing is not None else {}
    if set(found) != set(SPLITS):  # the helper could not answer: ImageFolder lists, or says why not
        found = {split: list_with_imagefolder(root / split) for split in SPLITS}
    if found["train"]["classes"] != found["test"]["classes"]:
        raise DatasetNotFoundError(
            f"{root}/train and {root}/test hold different class folders: make them match"
        )
    count = sum(len(split["samples"]) for split in found.values())
    decoded_bytes = count * 3 * IMAGE_SIZE * IMAGE_SIZE
    if cfg.decode is DecodeMode.auto:
        in_memory = decoded_bytes <= MEMORY_SHARE * available_memory_bytes()
        if not in_memory:
            log.info(
                "%d images (%.1f GB decoded) exceed %d%% of free memory: decoding them every epoch "
                "in the loader (data.decode=once to hold them anyway)",
                count,
                decoded_bytes / 1e9,
                100 * MEMORY_SHARE,
            )
    else:
        in_memory = cfg.decode is DecodeMode.once
    train, test = (
        load_image_split(
            root / split, found[split]["samples"], cfg, in_memory, processes, found[split]["fingerprint"]
        )
        for split in SPLITS
    )
    return Splits(train, test, found["train"]["classes"])


def list_with_imagefolder(folder: Path) -> dict:
    """As listing.py answers for one split (no fingerprint), from torchvision's ImageFolder."""
    from torchvision import datasets  # imported where used: see load_cifar10

    try:
        dataset = datasets.ImageFolder(folder)
    except (FileNotFoundError, OSError) as error:
        raise DatasetNotFoundError(imagefolder_missing(folder, str(error).splitlines()[0])) from None
    return {"classes": dataset.classes, "samples": dataset.samples, "fingerprint": None}
