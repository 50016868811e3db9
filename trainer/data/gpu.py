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
    PADDING,
    augmentation,
    crop_and_flip,
    cutout,
    cutout_corners,
)
from trainer.data.classic import EpochBatches
from trainer.data.sources import ImageSplit


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
    ):
        self.device = images.device
        self.labels = labels
        self.batch_size = batch_size
        self.augment = augment and train
        self.cutout = cutout if train else 0
        self.seed = seed
        self.images = F.pad(images, (PADDING,) * 4) if self.augment else images
        self.batches = EpochBatches(len(labels), batch_size, seed, rank, world_size, train)

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        self.batches.set_epoch(epoch, skip_batches)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # The DataLoader path's batches, drawn for the whole epoch and copied over at once.
        order, epoch = self.batches.epoch_indices(), self.batches.epoch
        index = torch.from_numpy(order).to(self.device)
        if self.augment:
            top, left, flip = (
                torch.from_numpy(np.ascontiguousarray(values)).to(self.device)
                for values in augmentation(self.seed, epoch, order)
            )
        if self.cutout:
            cut_top, cut_left = (
                torch.from_numpy(values).to(self.device)
                for values in cutout_corners(self.seed, epoch, order, self.cutout)
            )
        for start in range(0, len(order), self.batch_size):
            batch = slice(start, start + self.batch_size)
            if self.augment:
                images = crop_and_flip(self.images, index[batch], top[batch], left[batch], flip[batch])
            else:
                images = self.images[index[batch]]
            if self.cutout:
                images = cutout(images, cut_top[batch], cut_left[batch], self.cutout)
            yield images, self.labels[index[batch]]


def gpu_loaders(
    splits,
    augment: bool,
    batch_size: int,
    seed: int,
    rank: int,
    world_size: int,
    device: torch.device,
    cutout: int = 0,
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
            )
        )
    return loaders[0], loaders[1]
