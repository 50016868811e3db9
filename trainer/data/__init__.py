"""Data: sources (cifar10, synthetic, imagefolder) and two loaders over them, the torch
DataLoader (`classic`) and the GPU-resident one (`gpu`).

Both loaders yield uint8 batches; `Normalizer` turns them into the model's float input on
the device. Which images a rank sees and how each is augmented is a function of
(seed, epoch, image index) alone (`augment`), so worker count, rank count, resume points
and the loader kind leave the augmented images unchanged.

Files: sources/ (each source into Splits), augment.py (order and augmentation), classic.py
(the DataLoader path), gpu.py (the GPU-resident path); Normalizer here. Must not touch: the
pipeline's toggles (workers, pinning, copies, prefetch: trainer/perf/inputs.py), the model.
"""

from __future__ import annotations

import torch

from trainer.data.augment import CIFAR10_MEAN, CIFAR10_STD, IMAGE_SIZE, crop_and_flip
from trainer.data.classic import EpochLoader, torch_loaders
from trainer.data.gpu import GpuLoader, gpu_loaders
from trainer.data.sources import (
    CorruptImageError,
    DatasetNotFoundError,
    ImageSplit,
    Splits,
    begin_listing,
    load_source,
    synthetic_split,
)

__all__ = [
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "CorruptImageError",
    "DatasetNotFoundError",
    "EpochLoader",
    "GpuLoader",
    "IMAGE_SIZE",
    "ImageSplit",
    "Normalizer",
    "Splits",
    "begin_listing",
    "crop_and_flip",
    "gpu_loaders",
    "load_source",
    "synthetic_split",
    "torch_loaders",
]


class Normalizer:
    """uint8 images -> float32, normalized with CIFAR-10's mean and std, on their device
    (memory format kept)."""

    def __init__(self, device: torch.device, mean: tuple = CIFAR10_MEAN, std: tuple = CIFAR10_STD):
        std_t = torch.tensor(std, device=device).view(1, -1, 1, 1)
        self.scale = 1.0 / (255.0 * std_t)
        self.shift = -torch.tensor(mean, device=device).view(1, -1, 1, 1) / std_t

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        return images.float().mul_(self.scale).add_(self.shift)
