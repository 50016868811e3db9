"""The GPU-resident path: the whole uint8 dataset on the device, per-image crop and flip
done there in one gather per batch, no worker processes.

The order and the augmentation are those of the DataLoader path (trainer.data.augment), drawn
on the host once per epoch and copied over: both loaders give the same batches.
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
    ):
        self.device = images.device
        self.crop_flip = crop_flip
        self.labels = labels
        self.batch_size = batch_size
        self.augment = augment and train
        self.cutout = cutout if train else 0
        self.seed = seed
        self.images = self.padded(images) if self.augment else images
        self.batches = EpochBatches(len(labels), batch_size, seed, rank, world_size, train)

    def padded(self, images: torch.Tensor) -> torch.Tensor:
        """The images padded once for the crops, as the DataLoader path pads them (CropFlip.pad):
        zeros on the device; a reflection on the host (torch's reflect padding does not take
        uint8 on every device), then moved over."""
        if self.crop_flip.padding_mode == "constant":
            return F.pad(images, (self.crop_flip.padding,) * 4)
        return torch.from_numpy(self.crop_flip.pad(images.cpu().numpy())).to(self.device)

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        self.batches.set_epoch(epoch, skip_batches)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # The DataLoader path's batches, drawn for the whole epoch and copied over at once; the
        # epoch's images are augmented in a few large launches, so that each batch is a slice
        # (per-batch crop and cutout kernels cost 9% of a ResNet-18 step on an H200).
        order, epoch = self.batches.epoch_indices(), self.batches.epoch
        index = torch.from_numpy(order).to(self.device)
        images = torch.cat(
            [self.augmented(index, order, epoch, start) for start in range(0, len(order), CHUNK)]
        )
        labels = self.labels[index]
        for start in range(0, len(order), self.batch_size):
            yield images[start : start + self.batch_size], labels[start : start + self.batch_size]

    def augmented(self, index: torch.Tensor, order: np.ndarray, epoch: int, start: int) -> torch.Tensor:
        """Images order[start : start + CHUNK] of the epoch, cropped, flipped and cut out."""
        chunk = slice(start, start + CHUNK)
        if not self.augment:
            images = self.images[index[chunk]]
        else:
            top, left, flip = (
                torch.from_numpy(np.ascontiguousarray(values)).to(self.device)
                for values in self.crop_flip.draw(self.seed, epoch, order[chunk])
            )
            images = crop_and_flip(self.images, index[chunk], top, left, flip)
        if self.cutout:
            cut_top, cut_left = (
                torch.from_numpy(values).to(self.device)
                for values in cutout_corners(self.seed, epoch, order[chunk], self.cutout)
            )
            images = cutout(images, cut_top, cut_left, self.cutout)
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
) -> tuple[GpuLoader, GpuLoader]:
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
            )
        )
    return loaders[0], loaders[1]
