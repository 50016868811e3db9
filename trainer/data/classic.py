"""The torch DataLoader path: each worker builds whole uint8 batches.

The sampler hands out one `EpochBatch` (the epoch and the image indices of one batch) at a
time; the dataset turns it into a (B, 3, 32, 32) uint8 batch and its labels. Images held in
memory are cropped by indexing a pre-padded array and flipped by reversing a view, for the
whole batch at once; images decoded per epoch are read file by file. Conversion to float and
normalization happen on the device, after the copy (4x fewer bytes to pin and move).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from trainer.data.augment import (
    DEFAULT_CROP_FLIP,
    CropFlip,
    crop_and_flip_numpy,
    crop_windows,
    cutout_corners,
    cutout_numpy,
    epoch_order,
    rank_shard,
)
from trainer.data.sources import ImageSplit, decode_image

Batch = tuple[torch.Tensor, torch.Tensor]


class EpochBatch(NamedTuple):
    epoch: int
    indices: np.ndarray


class EpochBatches(Sampler):
    """This rank's batches of one epoch, as EpochBatch keys.

    Training: a permutation per epoch shared by every rank, each rank its own interleaved
    shard, the last partial batch dropped, and `set_epoch(epoch, skip_batches)` for a
    resumed epoch. Evaluation: every image once across ranks, in order."""

    def __init__(self, count: int, batch_size: int, seed: int, rank: int, world_size: int, train: bool):
        self.count, self.batch_size, self.seed = count, batch_size, seed
        self.rank, self.world_size, self.train = rank, world_size, train
        self.epoch, self.skip = 0, 0

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        self.epoch, self.skip = epoch, skip_batches

    def __len__(self) -> int:
        if self.train:
            return self.count // self.world_size // self.batch_size - self.skip
        return -(-len(rank_shard(self.count, self.rank, self.world_size)) // self.batch_size)

    def epoch_indices(self) -> np.ndarray:
        """The images of this epoch's remaining batches, in order (len(self) batches of them)."""
        if self.train:
            return self.training_indices(self.epoch)[self.skip * self.batch_size :]
        return rank_shard(self.count, self.rank, self.world_size)

    def training_indices(self, epoch: int) -> np.ndarray:
        """The images of every batch of a training epoch, from its first, in order."""
        order = epoch_order(self.count, self.seed, epoch, self.rank, self.world_size)
        return order[: self.count // self.world_size // self.batch_size * self.batch_size]

    def __iter__(self) -> Iterator[EpochBatch]:
        indices = self.epoch_indices()
        for start in range(0, len(indices), self.batch_size):
            yield EpochBatch(self.epoch, indices[start : start + self.batch_size])


def with_cutout(images: np.ndarray, seed: int, epoch: int, index: np.ndarray, size: int) -> np.ndarray:
    if size == 0:
        return images
    return cutout_numpy(images, *cutout_corners(seed, epoch, index, size), size)


class MemoryBatches(Dataset):
    """Batches cut from uint8 images held in memory."""

    def __init__(self, split: ImageSplit, seed: int, augment: bool, cutout: int, crop_flip: CropFlip):
        self.labels, self.seed, self.augment, self.cutout = split.labels, seed, augment, cutout
        self.crop_flip = crop_flip
        self.images = split.images.numpy()
        self.padded = crop_flip.pad(self.images) if augment else None
        self.windows = crop_windows(self.padded) if augment else None

    def __getstate__(self) -> dict:
        # `windows` is a strided view, (N, C, 9, 9, 32, 32) over the padded images: pickled (a
        # spawned DataLoader worker is sent its dataset) it would be copied out whole, 81x the
        # padded images. Workers rebuild the view from the padded images instead.
        return {**self.__dict__, "windows": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.padded is not None:
            self.windows = crop_windows(self.padded)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, key: EpochBatch) -> Batch:
        epoch, index = key
        if self.augment:
            crops = self.crop_flip.draw(self.seed, epoch, index)
            images = crop_and_flip_numpy(self.windows, index, *crops)
        else:
            images = self.images[index]
        images = with_cutout(images, self.seed, epoch, index, self.cutout)
        return torch.from_numpy(images), self.labels[index]


class FileBatches(Dataset):
    """Batches decoded file by file, every epoch (folders too large to hold in memory)."""

    def __init__(self, split: ImageSplit, seed: int, augment: bool, cutout: int, crop_flip: CropFlip):
        self.labels, self.files, self.seed, self.augment = split.labels, split.files, seed, augment
        self.cutout, self.crop_flip = cutout, crop_flip

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, key: EpochBatch) -> Batch:
        epoch, index = key
        images = np.stack([decode_image(self.files[i]) for i in index])
        if self.augment:
            crops = self.crop_flip.draw(self.seed, epoch, index)
            images = crop_and_flip_numpy(
                crop_windows(self.crop_flip.pad(images)), np.arange(len(index)), *crops
            )
        images = with_cutout(images, self.seed, epoch, index, self.cutout)
        return torch.from_numpy(images), self.labels[index]


class EpochLoader(DataLoader):
    """A DataLoader of whole batches whose sampler is told the epoch (and the batches to skip)."""

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        self.sampler.set_epoch(epoch, skip_batches)


def batches_of(
    split: ImageSplit,
    seed: int,
    augment: bool,
    cutout: int = 0,
    crop_flip: CropFlip = DEFAULT_CROP_FLIP,
) -> Dataset:
    kind = MemoryBatches if split.images is not None else FileBatches
    return kind(split, seed, augment, cutout, crop_flip)


def torch_loaders(
    splits,
    augment: bool,
    batch_size: int,
    seed: int,
    rank: int,
    world_size: int,
    loader_kwargs: dict,
    cutout: int = 0,
    crop_flip: CropFlip = DEFAULT_CROP_FLIP,
) -> tuple[EpochLoader, EpochLoader]:
    """cutout: the square's size in pixels for training batches (0: none); crop_flip: how
    they are cropped and flipped."""
    loaders = []
    for split, train in ((splits.train, True), (splits.test, False)):
        sampler = EpochBatches(len(split), batch_size, seed, rank, world_size, train)
        dataset = batches_of(split, seed, augment and train, cutout if train else 0, crop_flip)
        loaders.append(EpochLoader(dataset, batch_size=None, sampler=sampler, **loader_kwargs))
    return loaders[0], loaders[1]
