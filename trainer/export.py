"""The evaluated model (the weight average when ema is on) saved for inference, on the CPU.

The saved module takes what the loaders yield, uint8 images (N, 3, 32, 32), normalizes them
itself and returns logits, so a user needs neither this package nor its statistics:

    model = torch.export.load("export/model.pt2").module()      # export=export
    model = torch.jit.load("export/model.torchscript.pt")        # export=torchscript
    logits = model(images_uint8)

Must not touch: the trained weights (it exports a CPU copy), when to export (trainer/run.py).
"""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path

import torch
from torch import nn

from trainer.config import ExportFormat
from trainer.data import CIFAR10_MEAN, CIFAR10_STD, IMAGE_SIZE

log = logging.getLogger(__name__)

EXPORT_DIR = "export"
FILES = {ExportFormat.torchscript: "model.torchscript.pt", ExportFormat.export: "model.pt2"}


class InferenceModel(nn.Module):
    """uint8 images -> logits: the Normalizer's arithmetic, then the model in eval mode."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        std = torch.tensor(CIFAR10_STD).view(1, -1, 1, 1)
        self.register_buffer("scale", 1.0 / (255.0 * std))
        self.register_buffer("shift", -torch.tensor(CIFAR10_MEAN).view(1, -1, 1, 1) / std)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images.float() * self.scale + self.shift)


def export_model(model: nn.Module, fmt: ExportFormat, folder: Path) -> Path:
    """Write `model` in `fmt` into folder/export/ (atomically: a temporary file, then a rename);
    the batch size stays free."""
    inference = InferenceModel(copy.deepcopy(model).float()).to("cpu", memory_format=torch.contiguous_format)
    inference.eval()
    example = torch.zeros(2, 3, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.uint8)
    path = folder / EXPORT_DIR / FILES[fmt]
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".partial-{path.name}")
    with torch.no_grad():
        if fmt is ExportFormat.torchscript:
            torch.jit.trace(inference, example).save(str(temporary))
        else:
            batch = torch.export.Dim("batch", min=1)
            program = torch.export.export(inference, (example,), dynamic_shapes=({0: batch},))
            torch.export.save(program, temporary)
    os.replace(temporary, path)
    log.info("exported the evaluated model (%s) to %s", fmt.value, path)
    return path


def load_exported(path: Path) -> nn.Module:
    if path.suffix == ".pt2":
        return torch.export.load(path).module()
    return torch.jit.load(str(path))
