"""data=synthetic: CIFAR-shaped images whose label is learnable, made from the seed alone.

Must not touch: other sources, batching and augmentation (trainer/data/)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.config import DataConfig
from trainer.data.augment import IMAGE_SIZE
from trainer.data.sources.splits import ImageSplit, Splits


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
