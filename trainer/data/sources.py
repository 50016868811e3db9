"""Data sources: cifar10 (torchvision), synthetic, imagefolder (class folders).

Each split is an `ImageSplit`: labels, and the images as one (N, 3, 32, 32) uint8 tensor
when they are held in memory. Class folders are decoded once, in parallel, when the decoded
images fit in memory (`data.decode`); the decoded arrays can be kept next to the data
(`data.decode_cache`) so that the next run starts at once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import tempfile
import time
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torchvision import datasets
from tqdm import tqdm

from trainer.config import DataConfig, DataSource, DecodeMode, TrainerError
from trainer.data.augment import IMAGE_SIZE

log = logging.getLogger(__name__)

CACHE_FOLDER = ".trainer-cache"
MEMORY_SHARE = 0.25  # decode=auto holds decoded images in memory up to this share of what is free
DECODE_CHUNK = 512  # images per decoding task


class DatasetNotFoundError(TrainerError):
    pass


class CorruptImageError(TrainerError):
    """An image file that cannot be decoded. Raised in a DataLoader worker, it reaches the main
    process as this type with the worker's traceback in its message: keep only our line."""

    def __init__(self, message: str):
        marker = f"{type(self).__name__}: "
        if "Traceback" in message and marker in message:
            message = message.rsplit(marker, 1)[1].strip().splitlines()[0]
        super().__init__(message)


@dataclass
class ImageSplit:
    labels: torch.Tensor  # (N,) int64
    images: torch.Tensor | None = None  # (N, 3, 32, 32) uint8, or None: decoded from `files` per epoch
    files: list[str] | None = None  # image files (imagefolder), in label order

    def __len__(self) -> int:
        return len(self.labels)


@dataclass
class Splits:
    train: ImageSplit
    test: ImageSplit
    classes: list[str]


# ---------------------------------------------------------------- synthetic


def synthetic_split(size: int, train: bool, seed: int, num_classes: int = 10) -> ImageSplit:
    """CIFAR-shaped uint8 images whose label is learnable: a per-class low-frequency pattern
    plus noise. Train and test share the class patterns, not the images."""
    patterns = torch.Generator().manual_seed(seed)
    coarse = torch.rand(num_classes, 3, 4, 4, generator=patterns)
    class_patterns = F.interpolate(coarse, size=IMAGE_SIZE, mode="bilinear") * 96 + 80
    noise = torch.Generator().manual_seed(seed * 2 + (1 if train else 2))
    labels = torch.randint(0, num_classes, (size,), generator=noise)
    images = torch.empty(size, 3, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.uint8)
    for start in range(0, size, 8192):  # in chunks: 50k float images at once is 600 MB
        chunk = labels[start : start + 8192]
        jitter = torch.randn(len(chunk), 3, IMAGE_SIZE, IMAGE_SIZE, generator=noise) * 80
        images[start : start + 8192] = (class_patterns[chunk] + jitter).clamp(0, 255).to(torch.uint8)
    return ImageSplit(labels, images)


def load_synthetic(cfg: DataConfig, seed: int) -> Splits:
    return Splits(
        synthetic_split(cfg.train_size, train=True, seed=seed),
        synthetic_split(cfg.test_size, train=False, seed=seed),
        [f"class{i}" for i in range(10)],
    )


# ---------------------------------------------------------------- cifar10


def load_cifar10(cfg: DataConfig) -> Splits:
    root = Path(os.path.expanduser(cfg.root))
    try:
        train = datasets.CIFAR10(root, train=True, download=cfg.download)
        test = datasets.CIFAR10(root, train=False, download=cfg.download)
    except Exception as error:  # torchvision: RuntimeError when absent, URLError when offline
        if cfg.download:
            why = f"download failed: {str(error).splitlines()[0] if str(error) else type(error).__name__}"
        else:
            why = "no intact cifar-10-batches-py there and data.download=false"
        raise DatasetNotFoundError(
            f"CIFAR-10 not found in {root.resolve()} ({why}). Fix: "
            "data.root=/path/to/folder-with-cifar-10-batches-py, or "
            "data=imagefolder data.root=/path/to/class-folders, or data=synthetic"
        ) from None

    def split(dataset: datasets.CIFAR10) -> ImageSplit:
        images = torch.from_numpy(dataset.data).permute(0, 3, 1, 2).contiguous()  # NHWC -> NCHW
        return ImageSplit(torch.tensor(dataset.targets), images)

    return Splits(split(train), split(test), list(train.classes))


# ---------------------------------------------------------------- imagefolder


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


def fingerprint(folder: Path, samples: list[tuple[str, int]]) -> str:
    """Changes when any file is added, removed, renamed, relabelled, resized or touched."""
    digest = hashlib.sha1(f"{IMAGE_SIZE}".encode())
    for path, label in samples:
        stat = os.stat(path)
        name = os.path.relpath(path, folder)
        digest.update(f"{name}\t{label}\t{stat.st_size}\t{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


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
            if problem is None:
                pixels = np.empty(shape, dtype=np.uint8)
                complete = handle.readinto(memoryview(pixels).cast("B")) == pixels.nbytes
                if not complete or handle.read(1):
                    problem = "holds a different number of bytes than its header says"
                elif pixel_checksum(pixels) != header["crc32"]:
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


def load_image_split(
    folder: Path, samples: list[tuple[str, int]], cfg: DataConfig, in_memory: bool, processes: int
) -> ImageSplit:
    files = [path for path, _ in samples]
    labels = torch.tensor([label for _, label in samples], dtype=torch.int64)
    if not in_memory:
        return ImageSplit(labels, files=files)
    cache = folder.parent / CACHE_FOLDER / f"{folder.name}-{fingerprint(folder, samples)}{CACHE_SUFFIX}"
    shape = (len(labels), 3, IMAGE_SIZE, IMAGE_SIZE)
    images = read_cache(cache, shape) if cfg.decode_cache else None
    if images is not None:
        log.info("read %d decoded images of %s from %s", len(images), folder, cache)
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


def load_imagefolder(cfg: DataConfig, processes: int) -> Splits:
    root = Path(os.path.expanduser(cfg.root))
    found = {}
    for split in ("train", "test"):
        folder = root / split
        try:
            found[split] = datasets.ImageFolder(folder)
        except (FileNotFoundError, OSError) as error:
            raise DatasetNotFoundError(
                f"no class folders in {folder.resolve()} ({str(error).splitlines()[0]}). Fix: "
                "data.root=/path/with/train/<class>/ and test/<class>/ image folders, "
                "or data=cifar10, or data=synthetic"
            ) from None
    if found["train"].classes != found["test"].classes:
        raise DatasetNotFoundError(
            f"{root}/train and {root}/test hold different class folders: make them match"
        )
    count = sum(len(dataset) for dataset in found.values())
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
        load_image_split(root / split, found[split].samples, cfg, in_memory, processes)
        for split in ("train", "test")
    )
    return Splits(train, test, found["train"].classes)


def load_source(cfg: DataConfig, seed: int, processes: int = 1) -> Splits:
    """processes: how many may decode image files at once."""
    if cfg.source is DataSource.cifar10:
        return load_cifar10(cfg)
    if cfg.source is DataSource.imagefolder:
        return load_imagefolder(cfg, processes)
    return load_synthetic(cfg, seed)
