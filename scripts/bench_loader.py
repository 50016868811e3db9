"""Input pipeline alone (no model): the trainer's DataLoader path against the classic
torchvision pipeline of scripts/handwritten_loop.py, at the same workers and batch size.

    python scripts/bench_loader.py --data-root ../shared/datasets/cifar10-subset
    python scripts/bench_loader.py --workers 0,2 --batch-size 128 --epochs 3

Both read the same uint8 training images from memory (decoded once, outside the timing) and
hand out augmented batches: the classic one as normalized float32, the trainer's as uint8
(normalized on the device after the copy; here on the CPU, inside the timing). Images/s is
the median over the epochs after the first (worker start-up); the spread is min-max.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from argparse import Namespace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from handwritten_loop import classic_loader, training_images  # noqa: E402

from trainer.data import ImageSplit, Normalizer, Splits, torch_loaders  # noqa: E402


def epoch_rates(loader, epochs: int, images_per_batch: int, finish=lambda batch: batch) -> list[float]:
    rates = []
    for epoch in range(epochs):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        started, count = time.perf_counter(), 0
        for batch in loader:
            finish(batch)
            count += images_per_batch
        rates.append(count / (time.perf_counter() - started))
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data-root", default=None, help="class folders; default 50,000 synthetic images")
    parser.add_argument("--workers", default="2", help="comma-separated worker counts")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=4, help="the first is warm-up")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the main process only collects batches, as in training
    images, labels = training_images(args.data_root)
    normalize = Normalizer(torch.device("cpu"))
    print(
        f"{len(labels):,} images, batch {args.batch_size}, torch {torch.__version__}, "
        f"{len(os.sched_getaffinity(0))} cores"
    )
    print("| workers | classic torchvision img/s | trainer img/s | trainer / classic |")
    print("| ---: | ---: | ---: | ---: |")
    for workers in (int(w) for w in args.workers.split(",")):
        peer_args = Namespace(batch_size=args.batch_size, workers=workers, pin_memory=False)
        peer = classic_loader(images, labels, peer_args)
        peer_rates = epoch_rates(peer, args.epochs, args.batch_size)[1:]
        split = ImageSplit(labels, images)
        kwargs = {"num_workers": workers, "persistent_workers": workers > 0}
        train, _ = torch_loaders(Splits(split, split, []), True, args.batch_size, 0, 0, 1, kwargs)
        ours = epoch_rates(train, args.epochs, args.batch_size, lambda batch: normalize(batch[0]))[1:]
        peer_median, ours_median = statistics.median(peer_rates), statistics.median(ours)
        print(
            f"| {workers} | {peer_median:,.0f} ({min(peer_rates):,.0f}-{max(peer_rates):,.0f}) | "
            f"{ours_median:,.0f} ({min(ours):,.0f}-{max(ours):,.0f}) | {ours_median / peer_median:.2f}x |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
