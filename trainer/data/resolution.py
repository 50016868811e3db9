"""Progressive resizing: the first epochs train on downscaled images, the rest at full size.

    batches = LowResEpochs(train_loader, train_batches, size=24, epochs=10)
    batches.set_epoch(3); next(iter(batches))[0].shape  # (B, 3, 24, 24)

A convolutional net takes any image size; at 24x24 a ResNet-18 step does 56% of the work of a
32x32 one, and the early epochs, which learn coarse features, lose little by it (FFCV trains
ImageNet the same way, small first). The downscaling happens on the device, after the crop,
flip and cutout at full size, so both loaders and every augmentation stay as they are.

Owns: the size of an epoch's training batches and the downscaling. Must not touch: which
images and how they are augmented (trainer/data/augment.py), evaluation (always full size).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

Batch = tuple[torch.Tensor, torch.Tensor]


def downscale(images: torch.Tensor, size: int) -> torch.Tensor:
    """Antialiased bilinear resize to size x size, in the input's memory format."""
    channels_last = images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous()
    small = F.interpolate(images, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return small.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


class LowResEpochs:
    """The training loader and its device batches in one object: set_epoch goes to the loader,
    and while the epoch is below `epochs` every batch is downscaled to `size`."""

    def __init__(self, loader, batches: Iterable[Batch], size: int, epochs: int):
        self.loader, self.batches = loader, batches
        self.size, self.epochs = size, epochs
        self.epoch = 0

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        self.loader.set_epoch(epoch, skip_batches)
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Batch]:
        if self.epoch >= self.epochs:
            return iter(self.batches)
        return ((downscale(images, self.size), labels) for images, labels in self.batches)
