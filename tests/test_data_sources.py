"""The three data sources: cifar10 (its pickled batches), imagefolder (real images: the cnn
learns from them), synthetic (learnable and reproducible)."""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compose_config, needs_subset
from torchvision.datasets import CIFAR10

from trainer import Trainer
from trainer.config import to_train_config
from trainer.data import load_source, synthetic_split

CIFAR10_MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(3, 1, 1)
CIFAR10_STD = torch.tensor([0.2470, 0.2435, 0.2616]).view(3, 1, 1)
TRAIN_PER_BATCH, TEST_IMAGES = 20, 40


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


@pytest.fixture
def cifar10_root(tmp_path, monkeypatch) -> tuple[Path, dict[str, np.ndarray]]:
    """A tiny dataset in torchvision's cifar-10-batches-py layout: (root, {batch name: images}).

    torchvision checks each file's md5 against the real dataset's; point those at these files."""
    folder = tmp_path / "cifar10" / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    random = np.random.default_rng(0)
    sizes = {f"data_batch_{i}": TRAIN_PER_BATCH for i in range(1, 6)} | {"test_batch": TEST_IMAGES}
    images = {}
    for name, size in sizes.items():
        images[name] = random.integers(0, 256, (size, 3072), dtype=np.uint8)  # rows: R, G, B planes
        labels = [int(label) for label in random.integers(0, 10, size)]
        (folder / name).write_bytes(pickle.dumps({"data": images[name], "labels": labels}))
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": names}))

    checksums = {path.name: md5(path) for path in folder.iterdir()}
    monkeypatch.setattr(
        CIFAR10, "train_list", [[f"data_batch_{i}", checksums[f"data_batch_{i}"]] for i in range(1, 6)]
    )
    monkeypatch.setattr(CIFAR10, "test_list", [["test_batch", checksums["test_batch"]]])
    monkeypatch.setattr(CIFAR10, "meta", {**CIFAR10.meta, "md5": checksums["batches.meta"]})
    return folder.parent, images


def test_cifar10_source_trains_on_the_batches_it_finds(tmp_path, cifar10_root):
    root, images = cifar10_root
    cfg = compose_config("data=cifar10", f"data.root={root}", "data.download=false")  # batch 32

    trainer = Trainer(cfg, tmp_path / "run")
    metrics = trainer.fit()

    assert metrics["status"] == "completed"
    assert len(trainer.train_loader.dataset) == 5 * TRAIN_PER_BATCH
    assert metrics["steps"] == 5 * TRAIN_PER_BATCH // 32  # the last partial batch is dropped
    # The test loader is unshuffled and unaugmented: the fixture's first images, normalized
    # with CIFAR-10's own mean and std.
    first_images, first_labels = next(iter(trainer.test_batches))
    raw = torch.from_numpy(images["test_batch"][: len(first_images)]).view(-1, 3, 32, 32)
    expected = (raw.float() / 255 - CIFAR10_MEAN) / CIFAR10_STD
    torch.testing.assert_close(first_images, expected, atol=1e-5, rtol=0)
    test_labels = pickle.loads((root / "cifar-10-batches-py" / "test_batch").read_bytes())["labels"]
    assert first_labels.tolist() == test_labels[: len(first_labels)]


@needs_subset
def test_the_cnn_learns_real_images_from_class_folders(real_image_run):
    metrics = real_image_run["metrics"]

    # The trained weights reached 0.41-0.45 (seeds 0-2); chance is 0.10. The run's own
    # evaluations are of its weight average (see real_image_run), which learns along.
    assert metrics["status"] == "completed"
    assert real_image_run["trained_test_acc"] >= 0.35
    assert metrics["history"][-1]["test_acc"] > metrics["history"][0]["test_acc"]
    # what keeps the run short, counted rather than timed: each PNG decoded once for both epochs
    log = real_image_run["data_log"]
    assert log.count("decoded 5000 images of") == log.count("decoded 2000 images of") == 1


def test_synthetic_images_are_learnable(tmp_path):
    cfg = compose_config(
        "data.train_size=512", "data.augment=false", "epochs=2", "optim=adamw", "optim.lr=0.002"
    )

    metrics = Trainer(cfg, tmp_path / "run").fit()

    assert metrics["test_acc"] >= 0.5  # chance is 0.10; reaches ~0.99


def test_synthetic_images_depend_only_on_the_seed():
    data = to_train_config(compose_config()).data

    first, again, other_seed = load_source(data, seed=0), load_source(data, seed=0), load_source(data, seed=1)

    for split in ("train", "test"):
        assert torch.equal(getattr(first, split).images, getattr(again, split).images)
        assert torch.equal(getattr(first, split).labels, getattr(again, split).labels)
        assert not torch.equal(getattr(first, split).images, getattr(other_seed, split).images)
    assert not torch.equal(first.train.images[: len(first.test)], first.test.images)


def test_the_example_folder_holds_the_synthetic_images_in_the_imagefolder_layout(tmp_path):
    from trainer.data.example_folder import main

    assert main(["--out", str(tmp_path), "--train", "200", "--test", "100", "--seed", "3"]) == 0
    cfg = to_train_config(
        compose_config("data=imagefolder", f"data.root={tmp_path}", "data.decode=once")
    ).data
    read = load_source(cfg, seed=0)
    assert read.classes == [f"class{i}" for i in range(10)]  # each class has images in both splits
    for split, size, train in ((read.train, 200, True), (read.test, 100, False)):
        made = synthetic_split(size, train=train, seed=3)
        order = sorted(
            range(size), key=lambda i: (made.labels[i].item(), i)
        )  # class folders, then file names
        assert torch.equal(split.labels, made.labels[order]) and torch.equal(split.images, made.images[order])
    assert main(["--out", str(tmp_path)]) == 2  # never written into twice


@pytest.mark.parametrize(
    ("size", "train", "digest"), [(9000, True, "eb53fc72dffdca91"), (300, False, "a6ebb78a28d1fe5d")]
)
def test_synthetic_images_stay_the_images_they_were(size, train, digest):
    """The same seed makes the same images in every version (benchmarks on synthetic data compare
    like with like): the digests of two splits, one across a chunk's edge, as first made."""
    made = synthetic_split(size, train=train, seed=5)
    found = hashlib.sha256(made.images.numpy().tobytes() + made.labels.numpy().tobytes()).hexdigest()
    assert found[:16] == digest
