"""What every source hands over: an ImageSplit per split, the Splits of a dataset, and the
errors a missing or broken dataset raises.

Must not touch: how any source reads its files (the other files of this package).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.config import TrainerError


class DatasetNotFoundError(TrainerError):
    pass


class CorruptImageError(TrainerError):
    """An image file that cannot be decoded. Raised in a DataLoader worker, it reaches the main
    process as this type with the worker's traceback in its message: keep only our line."""

    def __init__(self, message: str):
        marker = f"{type(self).__name__}: "
        if "Traceback" in message and marker in message:
            message = message.rsplit(marker, 1)[1].strip().splitlines()[0]
        super().__init__(message)


@dataclass
class ImageSplit:
    labels: torch.Tensor  # (N,) int64
    images: torch.Tensor | None = None  # (N, 3, 32, 32) uint8, or None: decoded from `files` per epoch
    files: list[str] | None = None  # image files (imagefolder), in label order

    def __len__(self) -> int:
        return len(self.labels)


@dataclass
class Splits:
    train: ImageSplit
    test: ImageSplit
    classes: list[str]
