"""fastcnn: a small CIFAR net for training to 94% in seconds (model=fastcnn, recipe=fastcnn_94).

Its first conv is set from the data (`initialize_from_data`) and then fixed; trainer.models
hands it the training images once, before training.

Must not touch: the training (the loop trains it as any model).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

FASTCNN_WIDTHS = (64, 256, 256)
FASTCNN_WHITENING_CHANNELS = 24  # 12 eigenvectors of 2x2x3 patches, each with both signs
FASTCNN_HEAD_SCALE = 1 / 9  # small logits at the start: the softmax is not saturated by a fresh head
BATCHNORM_MOMENTUM = 0.4  # running statistics follow the last few batches of a short run
WHITENING_EPS = 5e-4  # added to the patch covariance's eigenvalues before the inverse square root
WHITENING_IMAGES = 5_000  # training images whose 2x2 patches set the whitening filters


def batch_norm(channels: int) -> nn.BatchNorm2d:
    """BatchNorm with its scale fixed at 1 (only the shift is learned, as in the fast CIFAR nets)."""
    norm = nn.BatchNorm2d(channels, momentum=BATCHNORM_MOMENTUM, eps=1e-12)
    norm.weight.requires_grad_(False)
    return norm


def conv3x3(in_channels: int, out_channels: int, conv_bias: bool) -> nn.Conv2d:
    """A 3x3 conv that starts close to passing its input through: its first in_channels filters
    are identities (dirac), so a deep stack of fresh convs does not scramble the signal."""
    conv = nn.Conv2d(in_channels, out_channels, 3, padding="same", bias=conv_bias)
    with torch.no_grad():
        nn.init.dirac_(conv.weight[:in_channels])
    return conv


class ConvGroup(nn.Sequential):
    """conv -> max-pool -> BN -> GELU -> conv -> BN -> GELU: halves the resolution."""

    def __init__(self, in_channels: int, out_channels: int, conv_bias: bool):
        super().__init__(
            conv3x3(in_channels, out_channels, conv_bias),
            nn.MaxPool2d(2),
            batch_norm(out_channels),
            nn.GELU(),
            conv3x3(out_channels, out_channels, conv_bias),
            batch_norm(out_channels),
            nn.GELU(),
        )


class Scale(nn.Module):
    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class FastCNN(nn.Sequential):
    """A small CIFAR net for training to 94% in seconds, after the published fast-CIFAR designs
    (Page's ResNet-9, Jordan's airbench): a frozen 2x2 whitening conv set from the data's patch
    statistics, three conv groups of 64, 256 and 256 channels, a max-pool and a scaled linear
    head. About 0.7 GFLOP per training image, 1.97M parameters."""

    def __init__(self, num_classes: int, conv_bias: bool = True, widths: tuple[int, ...] = FASTCNN_WIDTHS):
        first, middle, last = widths
        whiten = nn.Conv2d(3, FASTCNN_WHITENING_CHANNELS, 2, bias=True)
        whiten.weight.requires_grad_(False)  # set from the data (initialize_from_data), then fixed
        super().__init__(
            OrderedDict(
                whiten=whiten,
                act=nn.GELU(),
                layer1=ConvGroup(FASTCNN_WHITENING_CHANNELS, first, conv_bias),
                layer2=ConvGroup(first, middle, conv_bias),
                layer3=ConvGroup(middle, last, conv_bias),
                pool=nn.AdaptiveMaxPool2d(1),
                flatten=nn.Flatten(),
                head=nn.Linear(last, num_classes, bias=False),
                scale=Scale(FASTCNN_HEAD_SCALE),
            )
        )

    @torch.no_grad()
    def initialize_from_data(self, images: torch.Tensor) -> None:
        """Whitening filters from the covariance of the normalized training images' 2x2 patches:
        each eigenvector scaled by 1/sqrt(eigenvalue), with both signs, so the first layer hands on
        decorrelated inputs of unit variance (a step training would otherwise spend epochs on)."""
        count, total, products = 0, 0.0, 0.0
        for chunk in images[:WHITENING_IMAGES].split(500):  # bounded memory: 500 images' patches
            patches = F.unfold(chunk.float(), kernel_size=2).transpose(1, 2).flatten(0, 1).double()
            count, total, products = (
                count + len(patches),
                total + patches.sum(0),
                products + patches.T @ patches,
            )
        mean = total / count
        covariance = (products / count - torch.outer(mean, mean)).cpu()  # 12 x 12: no solver on a GPU
        eigenvalues, eigenvectors = torch.linalg.eigh(covariance)
        filters = (eigenvectors / torch.sqrt(eigenvalues + WHITENING_EPS)).T.flip(0)  # largest first
        filters = filters.reshape(-1, *self.whiten.weight.shape[1:]).to(self.whiten.weight)
        self.whiten.weight.copy_(torch.cat([filters, -filters]))

    def early_parameters(self) -> list[nn.Parameter]:
        """What optim.early_epochs trains only at the start: the whitening conv's bias."""
        return [self.whiten.bias]


def fastcnn(num_classes: int, conv_bias: bool = True, widths: tuple[int, ...] = FASTCNN_WIDTHS) -> nn.Module:
    return FastCNN(num_classes, conv_bias, widths)
