"""Data sources: cifar10 (torchvision), synthetic, imagefolder (class folders).

Each split is an `ImageSplit`: labels, and the images as one (N, 3, 32, 32) uint8 tensor
when they are held in memory. Class folders are decoded once, in parallel, when the decoded
images fit in memory (`data.decode`); the decoded arrays can be kept next to the data
(`data.decode_cache`) so that the next run starts at once.

Owns: reading each source into Splits, one file per source (cifar10.py, synthetic.py,
imagefolder.py), with the decode cache (decode_cache.py) and the shared types (splits.py).
A new source is a file here, a DataSource member and a line in load_source.
Must not touch: order, augmentation and batching (trainer/data/augment.py, classic.py, gpu.py).
"""

from __future__ import annotations

from trainer.config import DataConfig, DataSource
from trainer.data.sources.cifar10 import load_cifar10
from trainer.data.sources.decode_cache import CACHE_FOLDER, read_cache, write_cache
from trainer.data.sources.imagefolder import begin_listing, decode_image, load_imagefolder
from trainer.data.sources.listing import ListingAhead
from trainer.data.sources.splits import CorruptImageError, DatasetNotFoundError, ImageSplit, Splits
from trainer.data.sources.synthetic import load_synthetic, synthetic_split

__all__ = [
    "CACHE_FOLDER",
    "CorruptImageError",
    "DatasetNotFoundError",
    "ImageSplit",
    "ListingAhead",
    "Splits",
    "begin_listing",
    "decode_image",
    "load_cifar10",
    "load_imagefolder",
    "load_source",
    "load_synthetic",
    "read_cache",
    "synthetic_split",
    "write_cache",
]


def load_source(
    cfg: DataConfig, seed: int, processes: int = 1, listing: ListingAhead | None = None
) -> Splits:
    """processes: how many may decode image files at once; listing: begin_listing(cfg)'s, begun
    beside what ran since (data=imagefolder)."""
    if cfg.source is DataSource.cifar10:
        return load_cifar10(cfg)
    if cfg.source is DataSource.imagefolder:
        return load_imagefolder(cfg, processes, listing)
    return load_synthetic(cfg, seed)
