"""What reading data=imagefolder's decode cache costs in a fresh process, part by part: the
class folders listed (torchvision's ImageFolder), the files' fingerprint (a stat of each), the
cache read and its checksum, for the train and test splits, then the whole load again twice
(the second and third time in one process); then once with the listing and fingerprint from
the helper process a run begins beside its imports (trainer/data/sources/listing.py), here
with nothing beside it: what the helper takes when nothing hides it.

    python scripts/decode_cache_read.py ~/cifar10     # after one run with data.decode_cache=true

A development tool: it reads the cache and writes nothing.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from torchvision import datasets

import trainer.data.sources.decode_cache as decode_cache
import trainer.data.sources.imagefolder as imagefolder
from trainer.config import DataConfig, DataSource


def timed(name, function):
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        result = function(*args, **kwargs)
        print(f"  {name} {time.perf_counter() - started:.3f} s")
        return result

    return wrapper


def main() -> None:
    root = Path(sys.argv[1]).expanduser()
    imagefolder.fingerprint = timed("fingerprint", imagefolder.fingerprint)
    imagefolder.read_cache = timed("read_cache (read and checksum)", imagefolder.read_cache)
    decode_cache.pixel_checksum = timed("  of it the checksum", decode_cache.pixel_checksum)
    datasets.ImageFolder = timed("ImageFolder", datasets.ImageFolder)
    cfg = DataConfig(source=DataSource.imagefolder, root=str(root), decode_cache=True)
    for _ in range(3):
        started = time.perf_counter()
        imagefolder.load_imagefolder(cfg, processes=2)
        print(f"total {time.perf_counter() - started:.3f} s")
    started = time.perf_counter()
    begun = imagefolder.begin_listing(cfg)
    begun.result = timed("the helper's listing and fingerprint, waited for", begun.result)
    imagefolder.load_imagefolder(cfg, processes=2, listing=begun)
    print(f"total with the helper {time.perf_counter() - started:.3f} s")


if __name__ == "__main__":
    main()
