"""data.loader=gpu makes each training epoch's images as the epoch before it ends: the staged
epoch is the one a fresh loader would make, and a resume into another epoch or batch ignores it."""

from __future__ import annotations

import pytest
import torch
from test_toggles import coordinate_loaders

from trainer.data.augment import CropFlip


def batches(loader, epoch: int, skip: int = 0) -> list:
    loader.set_epoch(epoch, skip)
    return list(loader)


def assert_same(got: list, expected: list) -> None:
    assert len(got) == len(expected) > 0
    for (images, labels), (want_images, want_labels) in zip(got, expected):
        assert torch.equal(images.cpu(), want_images) and torch.equal(labels.cpu(), want_labels)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


@pytest.mark.parametrize("device", DEVICES)  # on CUDA the draws come over from page-locked memory
def test_consecutive_epochs_use_the_staged_images_and_they_are_the_fresh_ones(device):
    flip = CropFlip(alternate_flip=True)
    loaders = coordinate_loaders(600, 100, cutout=12, crop_flip=flip, device=device)
    staging, reference = loaders["gpu"], loaders["torch"]
    for epoch in range(3):
        got = batches(staging, epoch)
        assert staging.staged is not None and staging.staged[0] == (epoch + 1, 0)
        assert_same(got, batches(reference, epoch))


def test_a_resume_into_another_epoch_or_mid_epoch_ignores_the_staged_one():
    loaders = coordinate_loaders(600, 100, cutout=12)
    staging, reference = loaders["gpu"], loaders["torch"]
    batches(staging, 0)  # stages epoch 1 from its first batch
    assert_same(batches(staging, 1, skip=2), batches(reference, 1, skip=2))
    batches(staging, 4)
    assert_same(batches(staging, 7), batches(reference, 7))


def test_the_runs_last_epoch_stages_none_after_it():
    staging = coordinate_loaders(600, 100)["gpu"]
    staging.epochs = 2  # as gpu_loaders(..., epochs=2) sets it
    batches(staging, 0)
    assert staging.staged is not None and staging.staged[0] == (1, 0)
    batches(staging, 1)
    assert staging.staged is None


def test_a_partial_pass_stages_nothing():
    """The warm-up takes a few batches and leaves: the next full pass makes its own epoch."""
    staging = coordinate_loaders(600, 100)["gpu"]
    staging.set_epoch(0)
    next(iter(staging))
    assert staging.staged is None
