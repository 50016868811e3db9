"""Which images a rank sees in an epoch, and how each is augmented: pure functions of
(seed, epoch, image index), shared by both loaders.

No generator state is carried between calls, so worker count, rank count, the loader kind
and resume points leave the augmented images unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

IMAGE_SIZE = 32
PADDING = 4  # the crop's default padding: offsets -4..4 (data.crop_padding)
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)

# Cutout fills with the mean colour, which the Normalizer maps to about 0 (the usual fill of a
# cutout applied after normalization).
CUTOUT_FILL = tuple(round(255 * mean) for mean in CIFAR10_MEAN)

_MASK64 = np.uint64(2**64 - 1)
_CUTOUT_STREAM = np.uint64(0x5851F42D4C957F2D)  # keeps the cutout's bits apart from the crop's


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijection on uint64 whose output bits look independent."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (x ^ (x >> np.uint64(31))) & _MASK64


def epoch_key(seed: int, epoch: int) -> np.uint64:
    return _mix(_mix(np.asarray(seed, dtype=np.uint64)) ^ np.uint64(epoch))


def augmentation(
    seed: int, epoch: int, indices: np.ndarray, padding: int = PADDING, alternate_flip: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(top, left, flip) of each image's random crop of the image padded by `padding` (offsets
    0..2 x padding in the padded image) and horizontal flip in this epoch.

    alternate_flip: each image's flip is drawn once, for epoch 0, and inverted in every odd
    epoch, so that any two consecutive epochs show it both ways (the derandomized flip of
    Jordan, "94% on CIFAR-10 in 3.29 seconds", 2024); otherwise it is drawn anew each epoch."""
    positions = np.uint64(2 * padding + 1)
    indices = np.asarray(indices, dtype=np.uint64)
    bits = _mix(epoch_key(seed, epoch) ^ indices)
    top = (bits % positions).astype(np.int64)
    left = ((bits >> np.uint64(16)) % positions).astype(np.int64)
    flip_bits = _mix(epoch_key(seed, 0) ^ indices) if alternate_flip else bits
    flip = ((flip_bits >> np.uint64(32)) & np.uint64(1)).astype(bool)
    if alternate_flip and epoch % 2:
        flip = ~flip
    return top, left, flip


@dataclass(frozen=True)
class CropFlip:
    """A loader's crop and flip settings (data.crop_padding, data.flip, data.padding_mode):
    the padded images to crop from, and each epoch's crops and flips drawn by `augmentation`."""

    padding: int = PADDING
    alternate_flip: bool = False
    padding_mode: str = "constant"  # np.pad's mode: "constant" (zeros) or "reflect"

    def draw(self, seed: int, epoch: int, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return augmentation(seed, epoch, indices, self.padding, self.alternate_flip)

    def pad(self, images: np.ndarray) -> np.ndarray:
        """(N, C, H, W) uint8 -> padded by `padding` on each side of H and W, on the host, for the
        DataLoader path (the GPU loader pads the same way on its device: GpuLoader.padded)."""
        sides = (self.padding, self.padding)
        return np.pad(images, ((0, 0), (0, 0), sides, sides), mode=self.padding_mode)


DEFAULT_CROP_FLIP = CropFlip()  # 4-pixel zero padding, a random flip each epoch


def cutout_corners(seed: int, epoch: int, indices: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(top, left) of each image's cutout square in this epoch: its centre is uniform over the
    image, so the square may reach past an edge (the part inside is blanked)."""
    bits = _mix(_mix(epoch_key(seed, epoch) ^ np.asarray(indices, dtype=np.uint64)) ^ _CUTOUT_STREAM)
    top = (bits % np.uint64(IMAGE_SIZE)).astype(np.int64) - size // 2
    left = ((bits >> np.uint64(16)) % np.uint64(IMAGE_SIZE)).astype(np.int64) - size // 2
    return top, left


def cutout_square(top, left, size: int, steps):
    """(B, 1, 32, 32) booleans, true inside each image's square [top, top + size) x [left,
    left + size); numpy or torch alike (`steps`: 0..31 as either)."""
    rows = (steps >= top[:, None]) & (steps < top[:, None] + size)
    cols = (steps >= left[:, None]) & (steps < left[:, None] + size)
    return (rows[:, :, None] & cols[:, None, :])[:, None]


def cutout_numpy(images: np.ndarray, top: np.ndarray, left: np.ndarray, size: int) -> np.ndarray:
    """(B, C, 32, 32) uint8 with each image's square set to CUTOUT_FILL."""
    fill = np.asarray(CUTOUT_FILL, dtype=images.dtype)[None, :, None, None]
    return np.where(cutout_square(top, left, size, np.arange(IMAGE_SIZE)), fill, images)


def cutout(images: torch.Tensor, top: torch.Tensor, left: torch.Tensor, size: int) -> torch.Tensor:
    """`cutout_numpy` on a device tensor."""
    steps = torch.arange(IMAGE_SIZE, device=images.device)
    fill = torch.tensor(CUTOUT_FILL, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    return torch.where(cutout_square(top, left, size, steps), fill, images)


def epoch_order(count: int, seed: int, epoch: int, rank: int, world_size: int) -> np.ndarray:
    """This rank's training images for the epoch, in order: one permutation drawn for every
    rank, cut to a multiple of world_size, rank r taking positions r, r + world_size, ..."""
    generator = torch.Generator().manual_seed(int(epoch_key(seed, epoch) >> np.uint64(1)))
    order = torch.randperm(count, generator=generator).numpy()
    per_rank = count // world_size
    return order[rank : per_rank * world_size : world_size]


def rank_shard(size: int, rank: int, world_size: int) -> np.ndarray:
    """Every index exactly once across ranks (for evaluation: no padding, no duplicates)."""
    return np.arange(rank, size, world_size)


def crop_windows(padded: np.ndarray) -> np.ndarray:
    """A view of every IMAGE_SIZE window of each padded image: (N, C, 9, 9, 32, 32), no copy."""
    return np.lib.stride_tricks.sliding_window_view(padded, (IMAGE_SIZE, IMAGE_SIZE), axis=(2, 3))


def crop_and_flip_numpy(
    windows: np.ndarray, index: np.ndarray, top: np.ndarray, left: np.ndarray, flip: np.ndarray
) -> np.ndarray:
    """The batch's crops from `crop_windows`, mirrored where `flip`: (B, C, 32, 32) uint8."""
    channels = np.arange(windows.shape[1])[None, :]
    batch = windows[index[:, None], channels, top[:, None], left[:, None]]
    batch[flip] = batch[flip][..., ::-1]
    return batch


def crop_and_flip(
    padded: torch.Tensor, index: torch.Tensor, top: torch.Tensor, left: torch.Tensor, flip: torch.Tensor
) -> torch.Tensor:
    """The same crops on a device tensor, in one gather for the whole batch."""
    steps = torch.arange(IMAGE_SIZE, device=padded.device)
    rows = top[:, None] + steps
    cols = left[:, None] + torch.where(flip[:, None], steps.flip(0), steps)
    channels = torch.arange(padded.shape[1], device=padded.device)
    return padded[
        index[:, None, None, None],
        channels[None, :, None, None],
        rows[:, None, :, None],
        cols[:, None, None, :],
    ]
