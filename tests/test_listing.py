"""data=imagefolder's listing in a helper process (trainer/data/sources/listing.py): the same
classes, files, labels and fingerprint as torchvision's ImageFolder and the in-process
fingerprint, on layouts with ImageFolder's corners; what it cannot answer is left to ImageFolder;
the assembly begins it and the run reads the data through it."""

from __future__ import annotations

import gc
import logging
import os
import time

import numpy as np
import pytest
from conftest import compose_config, ended, ends_soon
from PIL import Image
from torchvision import datasets

from trainer import Trainer
from trainer.config import to_train_config
from trainer.data import begin_listing, load_source
from trainer.data.augment import IMAGE_SIZE
from trainer.data.sources import DatasetNotFoundError, imagefolder, listing

pytestmark = pytest.mark.skipif(not hasattr(os, "symlink"), reason="the layouts hold symbolic links")


def png(path, shade: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((IMAGE_SIZE, IMAGE_SIZE, 3), shade, dtype=np.uint8)).save(path)


@pytest.fixture
def corners(tmp_path):
    """Both splits with ImageFolder's corners: a nested folder, upper-case and other
    extensions, a file that is no image, a hidden image, a class folder and a nested folder
    that are links, a file at the split's top (not a class), names that sort by case."""
    root = tmp_path / "images"
    for split in ("train", "test"):
        top = root / split
        png(top / "bird" / "b.png", 10)
        png(top / "bird" / "A.PNG", 20)
        png(top / "bird" / "deep" / "er" / "c.jpeg", 30)
        png(top / "bird" / ".hidden.png", 40)
        (top / "bird" / "notes.txt").write_text("not an image")
        png(top / "Cat" / "z.png", 50)
        png(top / "elsewhere" / "x.png", 60)
        png(tmp_path / f"outside-{split}" / "y.png", 70)
        (top / "Cat" / "linked").symlink_to(tmp_path / f"outside-{split}", target_is_directory=True)
        (top / "dog").symlink_to(top / "elsewhere", target_is_directory=True)
        png(top / "stray.png", 80)
    return root


def imagefolder_answer(root) -> dict:
    found = {}
    for split in ("train", "test"):
        dataset = datasets.ImageFolder(root / split)
        found[split] = {
            "classes": dataset.classes,
            "samples": dataset.samples,
            "fingerprint": listing.fingerprint(str(root / split), dataset.samples, IMAGE_SIZE),
        }
    return found


def test_the_helper_lists_and_fingerprints_as_imagefolder_and_the_main_process_do(corners):
    expected = imagefolder_answer(corners)
    helper = listing.ListingAhead(str(corners), ("train", "test"), IMAGE_SIZE).result()

    assert helper == expected
    assert expected["train"]["classes"] == ["Cat", "bird", "dog", "elsewhere"]
    assert len(expected["train"]["samples"]) == 8  # every image; the text file and the stray left out
    assert listing.ListingAhead(str(corners), ("test",), None).result()["test"]["fingerprint"] is None


@pytest.mark.parametrize("layout", ["no split", "no classes", "a class without images"])
def test_a_layout_imagefolder_refuses_is_left_to_it_with_its_message(corners, tmp_path, layout):
    root = {"no split": tmp_path / "nowhere", "no classes": tmp_path / "flat"}.get(layout, corners)
    for split in ("train", "test"):
        if layout == "no classes":
            png(root / split / "stray.png", 90)
        if layout == "a class without images":
            (root / split / "empty").mkdir()
    cfg = to_train_config(compose_config("data=imagefolder", f"data.root={root}")).data

    assert listing.ListingAhead(str(root), ("train", "test"), IMAGE_SIZE).result() == {}
    with pytest.raises(DatasetNotFoundError) as in_process:
        load_source(cfg, seed=0)
    with pytest.raises(DatasetNotFoundError) as with_helper:
        load_source(cfg, seed=0, listing=begin_listing(cfg))
    assert str(with_helper.value) == str(in_process.value) and str(root) in str(in_process.value)


def test_a_run_reads_the_files_the_helper_found_by_its_fingerprint(corners, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    settings = ("data=imagefolder", f"data.root={corners}", "data.decode_cache=true", "batch_size=2")
    load_source(to_train_config(compose_config(*settings)).data, seed=0)  # the cache, listed here

    def not_listed_here(*args, **kwargs):
        raise AssertionError("listed or fingerprinted in the main process")

    monkeypatch.setattr(imagefolder, "list_with_imagefolder", not_listed_here)
    monkeypatch.setattr(imagefolder, "fingerprint", not_listed_here)
    trainer = Trainer(compose_config(*settings), tmp_path / "run")
    trainer.build()

    assert trainer.parts.classes == ["Cat", "bird", "dog", "elsewhere"]
    assert len(trainer.parts.train_loader) == 4  # 8 images in batches of 2
    assert caplog.text.count("read 8 decoded images") == 2  # the helper's fingerprints name the cache


def test_a_helper_that_fails_leaves_the_listing_to_imagefolder(corners, monkeypatch):
    cfg = to_train_config(compose_config("data=imagefolder", f"data.root={corners}")).data
    monkeypatch.setattr(listing.sys, "executable", str(corners / "no-python"))
    begun = begin_listing(cfg)
    assert begun.result() == {}
    assert load_source(cfg, seed=0, listing=begun).classes == ["Cat", "bird", "dog", "elsewhere"]


def test_a_listing_never_asked_for_leaves_no_helper(tmp_path):
    """A set-up that fails before the data drops its listing: the helper, blocked on an answer
    larger than the pipe holds, is ended, not left behind."""
    for split in ("train", "test"):
        folder = tmp_path / split / "class"
        folder.mkdir(parents=True)
        for index in range(2000):  # some 150 kB of answer
            (folder / f"image-with-a-long-name-{index:05d}.png").touch()
    begun = listing.ListingAhead(str(tmp_path), ("train", "test"), None)
    pid = begun.process.pid
    time.sleep(0.5)
    assert not ended(pid)  # blocked on its answer
    del begun
    gc.collect()
    assert ends_soon(pid)


def test_other_sources_begin_no_helper():
    assert begin_listing(to_train_config(compose_config("data=synthetic")).data) is None
