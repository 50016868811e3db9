"""data=cifar10: torchvision's CIFAR-10 batches, downloaded into data.root when asked.

Must not touch: other sources, batching and augmentation (trainer/data/)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from trainer.config import DataConfig
from trainer.data.sources.splits import DatasetNotFoundError, ImageSplit, Splits
from trainer.preflight import cifar10_missing

if TYPE_CHECKING:
    from torchvision import datasets


def load_cifar10(cfg: DataConfig) -> Splits:
    # torchvision is imported where it is used: `import torchvision` loads torch._dynamo (through
    # torchvision.ops), about 2 s of every process start that does not need it.
    from torchvision import datasets

    root = Path(os.path.expanduser(cfg.root))
    try:
        train = datasets.CIFAR10(root, train=True, download=cfg.download)
        test = datasets.CIFAR10(root, train=False, download=cfg.download)
    except Exception as error:  # torchvision: RuntimeError when absent, URLError when offline
        if cfg.download:
            why = f"download failed: {str(error).splitlines()[0] if str(error) else type(error).__name__}"
        else:
            why = "no intact cifar-10-batches-py there and data.download=false"
        raise DatasetNotFoundError(cifar10_missing(root, why)) from None

    def split(dataset: datasets.CIFAR10) -> ImageSplit:
        images = torch.from_numpy(dataset.data).permute(0, 3, 1, 2).contiguous()  # NHWC -> NCHW
        return ImageSplit(torch.tensor(dataset.targets), images)

    return Splits(split(train), split(test), list(train.classes))
