"""The GPU-resident path: the whole uint8 dataset on the device, per-image crop and flip
done there in one gather per batch, no worker processes.

The order and the augmentation are those of the DataLoader path (trainer.data.augment), drawn
on the host once per epoch and copied over: both loaders give the same batches. A training
epoch's images are made as the epoch before it ends (`staged`).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F

from trainer.data.augment import (
    DEFAULT_CROP_FLIP,
    CropFlip,
    crop_and_flip,
    cutout,
    cutout_corners,
)
from trainer.data.classic import EpochBatches
from trainer.data.sources import ImageSplit

# Images augmented per launch: a chunk bounds the scratch memory of the gather and the cutout
# mask whatever the dataset's size.
CHUNK = 4096


def reflected(size: int, padding: int, device: torch.device) -> torch.Tensor:
    """The source index of each position -padding .. size + padding - 1, mirrored about the edge
    rows without repeating them, as np.pad's "reflect" does (padding < size: config_checks)."""
    index = torch.arange(-padding, size + padding, device=device).abs()
    return torch.where(index >= size, 2 * (size - 1) - index, index)


class GpuLoader:
    """Training: every rank the same permutation, each its own shard; the last partial batch
    dropped. Evaluation (train=False): rank r takes images r, r + world_size, ... (each once)."""

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        batch_size: int,
        *,
        train: bool,
        augment: bool,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        cutout: int = 0,
        crop_flip: CropFlip = DEFAULT_CROP_FLIP,
        epochs: int | None = None,
    ):
        self.device = images.device
        self.epochs = epochs  # training epochs 0 .. epochs - 1: the last stages none after it
        self.crop_flip = crop_flip
        self.labels = labels
        self.batch_size = batch_size
        self.augment = augment and train
        self.cutout = cutout if train else 0
        self.seed = seed
        self.images = self.padded(images) if self.augment else images
        self.batches = EpochBatches(len(labels), batch_size, seed, rank, world_size, train)
        self.staged: tuple[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] | None = None

    def padded(self, images: torch.Tensor) -> torch.Tensor:
        """The images padded once for the crops, as the DataLoader path pads them (CropFlip.pad),
        on the device: zeros, or the image mirrored about its edges, gathered by index (torch's
        reflect padding does not take uint8 on every device). No trip to the host and back: np.pad
        there took 0.29 s of a fast-CNN run's set-up under cProfile (CIFAR-10, an H200 host),
        though walls on an H100 host did not show it against their spread
        (outputs/readme/gpu_h200x2_h100_2026-11-27.md)."""
        padding = self.crop_flip.padding
        if self.crop_flip.padding_mode == "constant":
            return F.pad(images, (padding,) * 4)
        rows, columns = (reflected(size, padding, images.device) for size in images.shape[-2:])
        return images[:, :, rows[:, None], columns]

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        self.batches.set_epoch(epoch, skip_batches)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        epoch, skip = self.batches.epoch, self.batches.skip
        if self.staged is not None and self.staged[0] == (epoch, skip):
            images, labels = self.staged[1]
        else:
            images, labels = self.epoch_images(epoch, self.batches.epoch_indices())
        self.staged = None
        for start in range(0, len(labels), self.batch_size):
            yield images[start : start + self.batch_size], labels[start : start + self.batch_size]
        if self.batches.train and (self.epochs is None or epoch + 1 < self.epochs):
            # The next epoch drawn on the host and launched now, while this epoch's last steps still
            # run on the device: between epochs (where the loop waits for the device) only a
            # lookup is left. Drawn there, it kept the fast CNN's GPU waiting 6% of each epoch.
            following = self.batches.training_indices(epoch + 1)
            self.staged = ((epoch + 1, 0), self.epoch_images(epoch + 1, following))

    def epoch_images(self, epoch: int, order: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The DataLoader path's batches of the epoch, augmented in a few large launches so that
        each batch is a slice (per-batch crop and cutout kernels cost 9% of a ResNet-18 step on
        an H200). The epoch's order and draws go over in one copy, from page-locked memory on
        CUDA, so that the host does not wait for the device's queue to empty."""
        draws = self.to_device(self.host_draws(epoch, order))
        chunks = [draws[:, start : start + CHUNK] for start in range(0, len(order), CHUNK)]
        images = torch.cat([self.augmented(chunk) for chunk in chunks])
        return images, self.labels[draws[0]]

    def host_draws(self, epoch: int, order: np.ndarray) -> np.ndarray:
        """(rows, images) int64: the order; with augment each image's crop top, left and flip;
        with cutout its square's top and left."""
        rows = [order]
        if self.augment:
            rows += self.crop_flip.draw(self.seed, epoch, order)
        if self.cutout:
            rows += cutout_corners(self.seed, epoch, order, self.cutout)
        return np.stack([np.asarray(row, dtype=np.int64) for row in rows])

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(array)
        if self.device.type != "cuda":
            return host.to(self.device)
        # torch's page-locked blocks are cached and kept until the copy from them is done
        return host.pin_memory().to(self.device, non_blocking=True)

    def augmented(self, draws: torch.Tensor) -> torch.Tensor:
        """One chunk of the epoch's images (`host_draws`' rows for them), cropped, flipped and cut out."""
        index, rest = draws[0], draws[1:]
        if not self.augment:
            images = self.images[index]
        else:
            top, left, flip = rest[:3]
            images = crop_and_flip(self.images, index, top, left, flip.bool())
            rest = rest[3:]
        if self.cutout:
            images = cutout(images, rest[0], rest[1], self.cutout)
        return images


def gpu_loaders(
    splits,
    augment: bool,
    batch_size: int,
    seed: int,
    rank: int,
    world_size: int,
    device: torch.device,
    cutout: int = 0,
    crop_flip: CropFlip = DEFAULT_CROP_FLIP,
    epochs: int | None = None,
) -> tuple[GpuLoader, GpuLoader]:
    """epochs: the run's, so that the last is not followed by a staged one (None: no end)."""
    loaders = []
    for split, train in ((splits.train, True), (splits.test, False)):
        split: ImageSplit
        loaders.append(
            GpuLoader(
                split.images.to(device),
                split.labels.to(device),
                batch_size,
                train=train,
                augment=augment,
                seed=seed,
                rank=rank,
                world_size=world_size,
                cutout=cutout,
                crop_flip=crop_flip,
                epochs=epochs,
            )
        )
    return loaders[0], loaders[1]
