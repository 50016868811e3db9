"""Data: sources (cifar10, synthetic, imagefolder) and loaders (torch DataLoader, GPU-resident).

Augmentation randomness is a function of (seed, epoch, image index) in both loaders, never
of the process that draws it: worker count, rank count and resume points leave the
augmented images unchanged.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from torchvision import datasets
from torchvision.transforms import v2

from trainer.config import DataConfig, DataSource, TrainerError

log = logging.getLogger(__name__)

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
IMAGE_SIZE = 32
PADDING = 4


class DatasetNotFoundError(TrainerError):
    pass


@dataclass
class Splits:
    train: Dataset  # items: (uint8 image, label); image a PIL image or a CHW uint8 tensor
    test: Dataset
    classes: list[str]


# ---------------------------------------------------------------- sources


class SyntheticImages(Dataset):
    """CIFAR-shaped uint8 images whose label is learnable: a per-class low-frequency
    pattern plus noise. Train and test share the class patterns, not the images."""

    def __init__(self, size: int, train: bool, seed: int, num_classes: int = 10):
        patterns = torch.Generator().manual_seed(seed)
        coarse = torch.rand(num_classes, 3, 4, 4, generator=patterns)
        self.patterns = F.interpolate(coarse, size=IMAGE_SIZE, mode="bilinear") * 96 + 80
        noise = torch.Generator().manual_seed(seed * 2 + (1 if train else 2))
        self.labels = torch.randint(0, num_classes, (size,), generator=noise)
        self.images = torch.empty(size, 3, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.uint8)
        for start in range(0, size, 8192):  # in chunks: 50k float images at once is 600 MB
            labels = self.labels[start : start + 8192]
            jitter = torch.randn(len(labels), 3, IMAGE_SIZE, IMAGE_SIZE, generator=noise) * 80
            self.images[start : start + 8192] = (self.patterns[labels] + jitter).clamp(0, 255).to(torch.uint8)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], int(self.labels[index])


def load_cifar10(cfg: DataConfig) -> Splits:
    root = Path(os.path.expanduser(cfg.root))
    try:
        train = datasets.CIFAR10(root, train=True, download=cfg.download)
        test = datasets.CIFAR10(root, train=False, download=cfg.download)
    except Exception as error:  # torchvision: RuntimeError when absent, URLError when offline
        if cfg.download:
            why = f"download failed: {str(error).splitlines()[0] if str(error) else type(error).__name__}"
        else:
            why = "no intact cifar-10-batches-py there and data.download=false"
        raise DatasetNotFoundError(
            f"CIFAR-10 not found in {root.resolve()} ({why}). Fix: "
            "data.root=/path/to/folder-with-cifar-10-batches-py, or "
            "data=imagefolder data.root=/path/to/class-folders, or data=synthetic"
        ) from None
    return Splits(train, test, list(train.classes))


def load_imagefolder(cfg: DataConfig) -> Splits:
    root = Path(os.path.expanduser(cfg.root))
    decode = v2.Compose([v2.ToImage(), v2.Resize(IMAGE_SIZE), v2.CenterCrop(IMAGE_SIZE)])
    splits = {}
    for split in ("train", "test"):
        folder = root / split
        try:
            splits[split] = datasets.ImageFolder(folder, transform=decode)
        except (FileNotFoundError, OSError) as error:
            raise DatasetNotFoundError(
                f"no class folders in {folder.resolve()} ({str(error).splitlines()[0]}). Fix: "
                "data.root=/path/with/train/<class>/ and test/<class>/ image folders, "
                "or data=cifar10, or data=synthetic"
            ) from None
    if splits["train"].classes != splits["test"].classes:
        raise DatasetNotFoundError(
            f"{root}/train and {root}/test hold different class folders: make them match"
        )
    return Splits(splits["train"], splits["test"], splits["train"].classes)


def load_synthetic(cfg: DataConfig, seed: int) -> Splits:
    classes = [f"class{i}" for i in range(10)]
    return Splits(
        SyntheticImages(cfg.train_size, train=True, seed=seed),
        SyntheticImages(cfg.test_size, train=False, seed=seed),
        classes,
    )


def load_source(cfg: DataConfig, seed: int) -> Splits:
    if cfg.source is DataSource.cifar10:
        return load_cifar10(cfg)
    if cfg.source is DataSource.imagefolder:
        return load_imagefolder(cfg)
    return load_synthetic(cfg, seed)


def as_uint8_tensors(dataset: Dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole dataset as (N, 3, 32, 32) uint8 images and (N,) int64 labels."""
    if isinstance(dataset, SyntheticImages):
        return dataset.images, dataset.labels
    if isinstance(dataset, datasets.CIFAR10):
        images = torch.from_numpy(dataset.data).permute(0, 3, 1, 2).contiguous()
        return images, torch.tensor(dataset.targets)
    to_tensor = v2.ToImage()
    pairs = [dataset[i] for i in range(len(dataset))]
    images = torch.stack([to_tensor(image) for image, _ in pairs])
    return images, torch.tensor([label for _, label in pairs])


# ---------------------------------------------------------------- torch DataLoader path


def sample_seed(seed: int, epoch: int, index: int) -> int:
    return ((seed * 1_000_003 + epoch) * 1_000_033 + index) % (2**62)


class SeededSampler(DistributedSampler):
    """DistributedSampler that pairs each index with the seed of its augmentation and can
    skip the batches a resumed epoch has already consumed."""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int, shuffle: bool):
        super().__init__(dataset, num_replicas, rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """skip: samples of this epoch already consumed (on this rank)."""
        super().set_epoch(epoch)
        self.skip = skip

    def __iter__(self) -> Iterator[tuple[int, int]]:
        indices = list(super().__iter__())[self.skip :]
        return iter([(index, sample_seed(self.seed, self.epoch, index)) for index in indices])

    def __len__(self) -> int:
        return self.num_samples - self.skip


class Transformed(Dataset):
    """`transform` applied to each image of `base`."""

    def __init__(self, base: Dataset, transform: v2.Transform):
        self.base = base
        self.transform = transform

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, label = self.base[index]
        return self.transform(image), label


class SeededAugmentation(Transformed):
    """Applies the transform under the seed that the sampler paired with the index."""

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, int]:
        index, seed = key
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            return super().__getitem__(index)


def image_transforms(augment: bool) -> v2.Compose:
    steps = [v2.ToImage()]
    if augment:
        steps += [v2.RandomCrop(IMAGE_SIZE, padding=PADDING), v2.RandomHorizontalFlip()]
    steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(CIFAR10_MEAN, CIFAR10_STD)]
    return v2.Compose(steps)


def rank_shard(size: int, rank: int, world_size: int) -> range:
    """Every index exactly once across ranks (for evaluation: no padding, no duplicates)."""
    return range(rank, size, world_size)


class EpochLoader(DataLoader):
    """A DataLoader whose sampler is told the epoch (and how many batches to skip)."""

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        self.sampler.set_epoch(epoch, skip_batches * self.batch_size)


def torch_loaders(
    splits: Splits,
    cfg: DataConfig,
    batch_size: int,
    seed: int,
    rank: int,
    world_size: int,
    loader_kwargs: dict,
) -> tuple[DataLoader, DataLoader]:
    train_set = SeededAugmentation(splits.train, image_transforms(cfg.augment))
    sampler = SeededSampler(train_set, world_size, rank, seed, shuffle=True)
    train = EpochLoader(train_set, batch_size, sampler=sampler, drop_last=True, **loader_kwargs)
    test_set = Subset(
        Transformed(splits.test, image_transforms(False)), rank_shard(len(splits.test), rank, world_size)
    )
    test = DataLoader(test_set, batch_size, shuffle=False, **loader_kwargs)
    return train, test


# ---------------------------------------------------------------- GPU-resident path


def crop_and_flip(
    padded: torch.Tensor, index: torch.Tensor, top: torch.Tensor, left: torch.Tensor, flip: torch.Tensor
) -> torch.Tensor:
    """Crop IMAGE_SIZE windows at (top, left) from padded images, mirrored where `flip`,
    in one gather for the whole batch."""
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


class GpuLoader:
    """The whole uint8 dataset on the device; per-image random crop (4-pixel zero padding)
    and horizontal flip done there in batches; a randperm per epoch; no worker processes.

    Training: every rank draws the same permutation and takes its own disjoint shard.
    Evaluation (shuffle=False): rank r takes images r, r + world_size, ... (each once).
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        batch_size: int,
        *,
        train: bool,
        augment: bool,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        mean: tuple = CIFAR10_MEAN,
        std: tuple = CIFAR10_STD,
    ):
        self.device = images.device
        self.labels = labels
        self.batch_size = batch_size
        self.train = train
        self.augment = augment and train
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.images = F.pad(images, (PADDING,) * 4) if self.augment else images
        std_t = torch.tensor(std, device=self.device).view(1, -1, 1, 1)
        self.scale = 1.0 / (255.0 * std_t)
        self.shift = -torch.tensor(mean, device=self.device).view(1, -1, 1, 1) / std_t
        self.epoch, self.skip = 0, 0

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        self.epoch, self.skip = epoch, skip_batches

    def __len__(self) -> int:
        if self.train:
            return len(self.labels) // self.world_size // self.batch_size - self.skip
        shard = len(rank_shard(len(self.labels), self.rank, self.world_size))
        return -(-shard // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        count = len(self.labels)
        if not self.train:
            order = torch.arange(self.rank, count, self.world_size, device=self.device)
        else:
            generator = torch.Generator(self.device).manual_seed(sample_seed(self.seed, self.epoch, 0))
            order = torch.randperm(count, device=self.device, generator=generator)
            # Augmentation drawn per image index (not per position): independent of rank count.
            top = torch.randint(0, 2 * PADDING + 1, (count,), device=self.device, generator=generator)
            left = torch.randint(0, 2 * PADDING + 1, (count,), device=self.device, generator=generator)
            flip = torch.rand(count, device=self.device, generator=generator) < 0.5
            per_rank = count // self.world_size
            order = order[: per_rank * self.world_size].view(per_rank, self.world_size)[:, self.rank]
        for batch in range(self.skip if self.train else 0, len(self) + (self.skip if self.train else 0)):
            index = order[batch * self.batch_size : (batch + 1) * self.batch_size]
            if self.augment:
                images = crop_and_flip(self.images, index, top[index], left[index], flip[index])
            else:
                images = self.images[index]
            yield images.float().mul_(self.scale).add_(self.shift), self.labels[index]


def gpu_loaders(
    splits: Splits,
    cfg: DataConfig,
    batch_size: int,
    seed: int,
    rank: int,
    world_size: int,
    device: torch.device,
) -> tuple[GpuLoader, GpuLoader]:
    loaders = []
    for dataset, train in ((splits.train, True), (splits.test, False)):
        images, labels = as_uint8_tensors(dataset)
        loaders.append(
            GpuLoader(
                images.to(device),
                labels.to(device),
                batch_size,
                train=train,
                augment=cfg.augment,
                seed=seed,
                rank=rank,
                world_size=world_size,
            )
        )
    return loaders[0], loaders[1]
