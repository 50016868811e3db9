"""Evaluation over the test set: loss and accuracy of the plain images, and with test-time
augmentation (TTA) the accuracy of the logits averaged over several views of each image.

The views of a batch go through the model as one batch (in eval mode BatchNorm uses its
running statistics, so this is the same as one pass per view, in fewer launches); the first
view is the image itself, so the plain numbers come from the same pass.

Owns: the TTA views, which epochs end with an evaluation (Plan), evaluate(). Must not touch:
when the loop calls it, what the run writes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trainer import distributed
from trainer.config import TtaMode
from trainer.distributed import Ranks

View = Callable[[torch.Tensor], torch.Tensor]
TRANSLATE_PIXELS = 1  # the translated views move the image this far along both axes


def identity(images: torch.Tensor) -> torch.Tensor:
    return images


def mirror(images: torch.Tensor) -> torch.Tensor:
    return images.flip(-1)


def translate(offset: int) -> View:
    """Shift by `offset` pixels down and right (negative: up and left), edges reflected."""

    def view(images: torch.Tensor) -> torch.Tensor:
        size = images.shape[-1]
        padded = F.pad(images, (TRANSLATE_PIXELS,) * 4, mode="reflect")
        start = TRANSLATE_PIXELS - offset
        return padded[..., start : start + size, start : start + size]

    return view


def flipped(view: View) -> View:
    return lambda images: mirror(view(images))


def tta_views(mode: TtaMode) -> list[View]:
    """The views whose logits are averaged; the first is always the image itself."""
    if mode is TtaMode.none:
        return [identity]
    if mode is TtaMode.flip:
        return [identity, mirror]
    shifted = [translate(TRANSLATE_PIXELS), translate(-TRANSLATE_PIXELS)]
    return [identity, mirror, *shifted, *(flipped(view) for view in shifted)]


@dataclass(frozen=True)
class Plan:
    """Which epochs end with an evaluation: every `every` epochs from `from_epoch` on, and the last."""

    from_epoch: int
    every: int

    def due(self, epoch: int, last: bool) -> bool:
        return last or (epoch >= self.from_epoch and epoch % self.every == 0)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    views: list[View],
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ranks: Ranks | None = None,
    unsure_share: float = 1.0,
) -> dict:
    """test_loss and test_acc of the plain images; test_acc_tta when there are several views.
    Summed across ranks (each rank holding its own shard of the test set). `unsure_share` below
    1: only that share of each batch, the images whose plain prediction is least sure, gets the
    other views; the rest keep their plain logits."""
    model.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=device)
    for images, labels in batches:
        with autocast():
            if len(views) > 1 and unsure_share < 1:
                plain, averaged = unsure_views_logits(model, images, views, unsure_share)
            else:
                logits = (
                    model(torch.cat([view(images) for view in views]))
                    .float()
                    .view(len(views), len(labels), -1)
                )
                plain, averaged = logits[0], logits.mean(dim=0)
        totals += torch.stack(
            [
                F.cross_entropy(plain, labels, reduction="sum").double(),
                (plain.argmax(dim=1) == labels).sum().double(),
                torch.tensor(labels.numel(), dtype=torch.float64, device=labels.device),
                (averaged.argmax(dim=1) == labels).sum().double(),
            ]
        )
    loss, correct, count, correct_tta = distributed.all_reduce_sum(totals, ranks or Ranks()).tolist()
    result = {"test_loss": loss / count, "test_acc": correct / count}
    if len(views) > 1:
        result["test_acc_tta"] = correct_tta / count
    return result


def unsure_views_logits(
    model: nn.Module, images: torch.Tensor, views: list[View], share: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(plain logits, logits averaged over the views for the ceil(share x batch) images with the
    smallest gap between their two likeliest classes, plain for the others). A fixed count per
    batch size, so that a compiled model sees a fixed shape."""
    plain = model(images).float()
    count = math.ceil(share * len(images))
    top2 = plain.softmax(dim=1).topk(2, dim=1).values
    unsure = (top2[:, 0] - top2[:, 1]).topk(count, largest=False).indices
    others = model(torch.cat([view(images[unsure]) for view in views[1:]])).float()
    averaged = plain.clone()
    averaged[unsure] = (plain[unsure] + others.view(len(views) - 1, count, -1).sum(dim=0)) / len(views)
    return plain, averaged
