"""The input pipeline: class folders decoded once (in parallel, optionally kept on disk) give
the same batches as decoding file by file; a corrupt image is one line naming the file; the
worker count that num_workers=auto picks."""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle

import numpy as np
import pytest
import torch
from conftest import SMALL, compose_config, run_cli
from PIL import Image

from trainer import Trainer
from trainer.assembly import build_data
from trainer.config import to_train_config
from trainer.data import CorruptImageError, Splits, load_source, torch_loaders
from trainer.data.augment import DEFAULT_CROP_FLIP, CropFlip
from trainer.data.example_folder import write_folder
from trainer.data.sources.synthetic import synthetic_split
from trainer.distributed import Ranks
from trainer.perf import dataloader_kwargs, worker_count

CLASSES = ("cat", "dog", "ship")


@pytest.fixture
def image_folder(tmp_path):
    """train/ and test/ class folders of small PNGs and JPEGs, one of another size (resized)."""
    random = np.random.default_rng(0)
    for split, count in (("train", 16), ("test", 6)):
        for label, name in enumerate(CLASSES):
            folder = tmp_path / "images" / split / name
            folder.mkdir(parents=True)
            for index in range(count):
                pixels = random.integers(0, 256, (32, 32, 3), dtype=np.uint8) // (label + 1)
                Image.fromarray(pixels).save(folder / f"{index}.png")
    Image.fromarray(random.integers(0, 256, (48, 40, 3), dtype=np.uint8)).save(
        tmp_path / "images" / "train" / "cat" / "large.jpg"
    )
    return tmp_path / "images"


def data_config(root, *overrides: str):
    return to_train_config(compose_config("data=imagefolder", f"data.root={root}", *overrides)).data


def epoch_batches(
    splits, epoch: int, crop_flip: CropFlip = DEFAULT_CROP_FLIP, **loader_kwargs
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    train, _ = torch_loaders(splits, True, 8, 0, 0, 1, loader_kwargs, crop_flip=crop_flip)
    train.set_epoch(epoch)
    return list(train)


@pytest.mark.parametrize("padding_mode", ["constant", "reflect"])
def test_decoding_once_gives_the_batches_of_decoding_every_epoch(image_folder, padding_mode):
    crop_flip = CropFlip(padding_mode=padding_mode)
    once = load_source(data_config(image_folder, "data.decode=once"), seed=0, processes=2)
    every_epoch = load_source(data_config(image_folder, "data.decode=every_epoch"), seed=0)

    assert once.train.images.shape == (49, 3, 32, 32) and every_epoch.train.images is None
    assert once.classes == list(CLASSES) and len(every_epoch.test) == 18
    for epoch in (0, 1):
        held = epoch_batches(once, epoch, crop_flip)
        decoded = epoch_batches(every_epoch, epoch, crop_flip, num_workers=2)
        assert len(held) == len(decoded) == 49 // 8
        for (a, labels_a), (b, labels_b) in zip(held, decoded):
            assert a.dtype == torch.uint8 and torch.equal(a, b) and torch.equal(labels_a, labels_b)


def test_decoded_images_are_kept_for_the_next_run_until_a_file_changes(image_folder, caplog):
    caplog.set_level(logging.INFO)
    cfg = data_config(image_folder, "data.decode_cache=true")

    first = load_source(cfg, seed=0)
    kept = sorted(path.name for path in (image_folder / ".trainer-cache").iterdir())
    again = load_source(cfg, seed=0)
    os.utime(image_folder / "train" / "dog" / "3.png", ns=(0, 0))
    after_change = load_source(cfg, seed=0)

    assert [name.split("-")[0] for name in kept] == ["test", "train"]
    assert torch.equal(first.train.images, again.train.images)
    assert torch.equal(first.train.images, after_change.train.images)
    assert caplog.text.count("decoded 49 images of") == 2  # the first run and after the change
    assert caplog.text.count("read 49 decoded images") == 1 and caplog.text.count("read 18 decoded") == 2
    assert len(list((image_folder / ".trainer-cache").glob("train-*.pixels"))) == 2  # a new fingerprint
    assert not list((image_folder / ".trainer-cache").glob("*.tmp"))


@pytest.mark.parametrize(
    "decode, workers", [("once", 0), ("every_epoch", 0), ("every_epoch", 2)], ids=["once", "files", "workers"]
)
def test_a_corrupt_image_is_one_line_naming_the_file(image_folder, tmp_path, decode, workers):
    corrupt = image_folder / "test" / "dog" / "5.png"  # every test image is read, in any mode
    corrupt.write_bytes(b"not a png")
    cfg = compose_config(
        "data=imagefolder", f"data.root={image_folder}", f"data.decode={decode}", f"num_workers={workers}"
    )

    try:  # not pytest.raises: its kept traceback would keep the DataLoader's workers alive
        Trainer(cfg, tmp_path / "run").fit()
        message = None
    except CorruptImageError as error:
        message = str(error)

    assert message.startswith(f"cannot decode image {corrupt} (cannot identify image file")
    assert message.endswith("remove or replace the file, then run again")
    assert "\n" not in message
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_corrupt_image_stops_the_command_before_training(image_folder, tmp_path):
    corrupt = image_folder / "test" / "ship" / "0.png"
    corrupt.write_bytes(b"\x89PNG broken")

    result = run_cli(*SMALL, "data=imagefolder", f"data.root={image_folder}", cwd=tmp_path)

    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert result.returncode == 1 and "Traceback" not in result.stdout + result.stderr
    assert len(errors) == 1 and f"cannot decode image {corrupt}" in errors[0]
    assert not list(tmp_path.rglob("*.pt"))
    assert "epoch 1/1" not in result.stdout  # found while loading, not after an epoch


def test_a_dataset_sent_to_a_spawned_worker_is_its_images_not_every_crop_of_them():
    images = synthetic_split(64, train=True, seed=0)
    train, _ = torch_loaders(Splits(images, images, []), True, 8, 0, 0, 1, {})
    train.set_epoch(1)
    key = next(iter(train.sampler))
    dataset = train.dataset
    sent = pickle.dumps(dataset)
    received = pickle.loads(sent)

    assert len(sent) < 3 * dataset.padded.nbytes < dataset.windows.size  # 81 crop windows per image
    for got, expected in zip(received[key], dataset[key], strict=True):
        assert torch.equal(got, expected)


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="this platform cannot fork")
def test_dataloader_workers_are_forked_where_the_platform_can():
    cfg = to_train_config(compose_config("num_workers=2"))

    kwargs = dataloader_kwargs(cfg, torch.device("cpu"))
    assert kwargs["multiprocessing_context"].get_start_method() == "fork"


@pytest.mark.parametrize(
    "device, cores, processes, in_memory, expected",
    [
        ("cpu", 16, 1, False, 0),
        ("cuda", 16, 1, False, 4),
        ("cuda", 32, 2, False, 4),
        ("cuda", 6, 2, False, 2),
        ("cuda", 2, 1, False, 1),
        ("cuda", 16, 1, True, 0),
        ("cuda", 32, 2, True, 0),
    ],
)
def test_num_workers_auto(monkeypatch, device, cores, processes, in_memory, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cores)))
    cfg = to_train_config(compose_config())

    assert cfg.num_workers == "auto"
    assert worker_count(cfg, torch.device(device), processes, in_memory) == expected
    three = to_train_config(compose_config("num_workers=3"))
    assert worker_count(three, torch.device(device), 1, in_memory) == 3


def test_num_workers_auto_starts_workers_only_for_images_decoded_file_by_file(monkeypatch, tmp_path):
    """The loader a run builds: no worker processes over decoded images, workers where each
    batch decodes its files."""
    write_folder(tmp_path, train=100, test=100, seed=0)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(8)))
    cuda = torch.device("cuda")  # the worker count is decided before anything touches the device
    for decode, expected in (("once", 0), ("every_epoch", 4)):
        folder = ("data=imagefolder", f"data.root={tmp_path}", f"data.decode={decode}")
        cfg = to_train_config(compose_config(*folder, "batch_size=50"))
        monkeypatch.setattr("trainer.perf.device_batches", lambda _cfg, loader, _device: loader)
        _, train, _, test, _ = build_data(cfg, Ranks(), cuda)
        assert (train.num_workers, test.num_workers) == (expected, expected)


def test_baseline_turns_the_input_pipeline_off_and_the_default_turns_it_on():
    baseline, default = (to_train_config(compose_config(f"perf={name}")) for name in ("baseline", "default"))

    assert (baseline.num_workers, baseline.pin_memory, baseline.non_blocking) == (0, False, False)
    assert (default.num_workers, default.pin_memory, default.non_blocking) == ("auto", True, True)
    assert to_train_config(compose_config()) == default  # perf=default is what runs without a preset
