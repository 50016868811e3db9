"""Faults in what a user hands the trainer, as tables: a decode cache damaged on disk, a
model.target whose code fails or does not fit, settings that cannot act or make no sense.
Each is answered in one line naming what is wrong: never used silently, never a traceback.
(The run-folder faults live in test_faults.py.)"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import HANG_GUARD_S, SMALL, cli_environment, compose_config
from PIL import Image
from torch import nn

from trainer import Trainer
from trainer.cli_checks import check_command_line
from trainer.config import ConfigError, to_train_config
from trainer.data import load_source
from trainer.data.sources import CACHE_FOLDER, read_cache, write_cache
from trainer.optim import build_optimizer, peak_lr
from trainer.perf import unused_ddp_toggles

# ---------------------------------------------------------------- the decode cache (R5)


@pytest.fixture
def image_folder(tmp_path):
    """train/ and test/ class folders of a few small PNGs."""
    random = np.random.default_rng(0)
    for split, count in (("train", 4), ("test", 2)):
        for name in ("cat", "dog", "ship"):
            folder = tmp_path / "images" / split / name
            folder.mkdir(parents=True)
            for index in range(count):
                Image.fromarray(random.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(
                    folder / f"{index}.png"
                )
    return tmp_path / "images"


def cached_data(root: Path):
    return to_train_config(
        compose_config("data=imagefolder", f"data.root={root}", "data.decode=once", "data.decode_cache=true")
    ).data


def cache_file(root: Path, split: str) -> Path:
    [path] = [path for path in (root / CACHE_FOLDER).glob(f"{split}-*") if not path.name.endswith(".tmp")]
    return path


def edit_one_pixel(path: Path, images: torch.Tensor) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the last byte of either layout is a pixel
    path.write_bytes(bytes(data))


def zero_the_pixels(path: Path, images: torch.Tensor) -> None:
    data = bytearray(path.read_bytes())
    data[-images.numel() :] = bytes(images.numel())
    path.write_bytes(bytes(data))


def replace_with_saved_zeros(path: Path, images: torch.Tensor) -> None:
    with open(path, "wb") as handle:
        np.save(handle, np.zeros_like(images.numpy()))


def keep_channels_last(path: Path, images: torch.Tensor) -> None:
    write_cache(path, images.permute(0, 2, 3, 1).contiguous())  # a whole, checksummed file


def cut_in_half(path: Path, images: torch.Tensor) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@dataclass
class CacheFault:
    split: str
    damage: Callable[[Path, torch.Tensor], None]
    problem: str  # what the log line says of the file


CACHE_FAULTS = {
    "train-pixel-edited": CacheFault(
        "train", edit_one_pixel, "holds pixels that do not match their checksum (changed since written)"
    ),
    "test-zeroed-in-place": CacheFault(
        "test", zero_the_pixels, "holds pixels that do not match their checksum (changed since written)"
    ),
    "test-replaced-by-saved-zeros": CacheFault(
        "test",
        replace_with_saved_zeros,
        "cannot be read as a decode cache ('utf-8' codec can't decode byte 0x93 in position 0: "
        "invalid start byte)",
    ),
    "train-wrong-shape": CacheFault(
        "train", keep_channels_last, "holds uint8 images of shape [12, 32, 32, 3], not uint8 [12, 3, 32, 32]"
    ),
    "train-truncated": CacheFault(
        "train", cut_in_half, "holds a different number of bytes than its header says"
    ),
}


@pytest.mark.parametrize("fault", CACHE_FAULTS.values(), ids=CACHE_FAULTS.keys())
def test_a_damaged_decode_cache_is_one_line_and_a_fresh_decode(image_folder, caplog, fault):
    caplog.set_level(logging.INFO)
    cfg = cached_data(image_folder)
    decoded = getattr(load_source(cfg, seed=0), fault.split).images
    cache = cache_file(image_folder, fault.split)
    fault.damage(cache, decoded)

    caplog.clear()
    after_damage = load_source(cfg, seed=0)
    warnings = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    caplog.clear()
    next_run = load_source(cfg, seed=0)

    assert warnings == [f"decode cache {cache} {fault.problem}: decoding the images again"]
    assert torch.equal(getattr(after_damage, fault.split).images, decoded)
    assert torch.equal(getattr(next_run, fault.split).images, decoded)  # the file was made whole again
    assert f"read {len(decoded)} decoded images" in caplog.text
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING]


def test_two_runs_keeping_the_same_cache_at_once_leave_only_whole_files(tmp_path, caplog):
    images = torch.randint(0, 256, (300, 3, 32, 32), dtype=torch.uint8)
    path = tmp_path / CACHE_FOLDER / "train-0123456789abcdef.pixels"

    def keep() -> None:
        for _ in range(10):
            write_cache(path, images)

    writers = [threading.Thread(target=keep) for _ in range(2)]
    for writer in writers:
        writer.start()
    reads = []
    while any(writer.is_alive() for writer in writers):
        reads.append(read_cache(path, tuple(images.shape)))
    for writer in writers:
        writer.join()

    assert not [record for record in caplog.records if record.levelno >= logging.WARNING]
    assert all(read is None or torch.equal(read, images) for read in reads)
    assert torch.equal(read_cache(path, tuple(images.shape)), images)
    assert [file.name for file in path.parent.iterdir()] == [path.name]


def test_images_read_from_the_cache_and_changed_in_place_leave_the_file_as_written(tmp_path):
    images = torch.randint(0, 256, (40, 3, 32, 32), dtype=torch.uint8)
    path = tmp_path / CACHE_FOLDER / "train-0123456789abcdef.pixels"
    write_cache(path, images)
    written = path.read_bytes()
    read = read_cache(path, tuple(images.shape))
    read += 1  # the run's own copy (the file is mapped copy-on-write)
    assert path.read_bytes() == written
    assert torch.equal(read_cache(path, tuple(images.shape)), images)
    path.write_bytes(written + b"x")  # one byte more than the header says
    assert read_cache(path, tuple(images.shape)) is None


# ---------------------------------------------------------------- the user's model code (R4)

FAULTY_NETS = """\
import torch
from torch import nn

MEAN = torch.tensor([0.5, 0.5, 0.5]).view(1, 3, 1, 1)  # made as the module is imported


def raises(num_classes):
    raise RuntimeError("this model needs a GPU")


def no_arguments():
    return nn.Linear(3 * 32 * 32, 10)


def seven_classes(num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 7))


def wrong_input(num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(100, num_classes))


class Head(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.linear = nn.Linear(3 * 32 * 32, num_classes)


class Pair(Head):
    def forward(self, x):
        return self.linear(x.flatten(1)), x


class Broken(Head):
    def forward(self, x):
        return self.linear(x.flatten(1)) + self.bias


class Centered(Head):
    def forward(self, x):
        return self.linear((x - MEAN).flatten(1))


class Itemized(Head):
    def forward(self, x):
        return self.linear(x.flatten(1)) * (1 + 0 * x.abs().max().item())


def on_meta(num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, num_classes, device="meta"))
"""


@pytest.fixture
def faulty_nets(tmp_path, monkeypatch):
    """The user's module, importable as `faulty_nets` and imported afresh by each test."""
    (tmp_path / "faulty_nets.py").write_text(FAULTY_NETS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "faulty_nets", raising=False)
    yield tmp_path
    sys.modules.pop("faulty_nets", None)


FIX = "fix the model's code, or train a built-in model with model.target=null"
TARGET_FAULTS = {
    "raises": f"model.target=faulty_nets:raises: raises(10) raised RuntimeError: this model needs a GPU at "
    f"faulty_nets.py:8: {FIX}",
    "no_arguments": "model.target=faulty_nets:no_arguments: no_arguments() cannot be called with the number "
    "of classes alone: define it as no_arguments(num_classes) returning a torch.nn.Module",
    "seven_classes": "model.target=faulty_nets:seven_classes: a (2, 3, 32, 32) batch of images gave shape "
    "(2, 7), not logits of shape (2, 10) (images, classes): make seven_classes(num_classes) return a model "
    "whose forward gives one logit per class",
    # torch's own words: prefixed with the operator ('addmm: ') or not, by which kernel raised
    "wrong_input": re.compile(
        re.escape("model.target=faulty_nets:wrong_input: its forward pass of a (2, 3, 32, 32) batch raised ")
        + r"RuntimeError: (\w+: )?"
        + re.escape(f"mat1 and mat2 shapes cannot be multiplied (2x3072 and 100x10): {FIX}")
    ),
    "Pair": "model.target=faulty_nets:Pair: a (2, 3, 32, 32) batch of images gave a tuple, not logits of "
    "shape (2, 10) (images, classes): make Pair(num_classes) return a model whose forward gives one logit "
    "per class",
    "Broken": "model.target=faulty_nets:Broken: its forward pass of a (2, 3, 32, 32) batch raised "
    f"AttributeError: 'Broken' object has no attribute 'bias' at faulty_nets.py:36: {FIX}",
    "on_meta": "model.target=faulty_nets:on_meta: 1.weight and 1 more of the model on_meta(10) returned are "
    "on the meta device, which holds no values to train: create the model's tensors on the CPU (no "
    "device='meta', no empty-weight initialization)",
}


@pytest.mark.parametrize(("target", "message"), TARGET_FAULTS.items(), ids=TARGET_FAULTS.keys())
def test_a_failing_model_target_is_one_line_naming_it(faulty_nets, target, message):
    with pytest.raises(ConfigError) as caught:
        check_command_line([*SMALL, f"model.target=faulty_nets:{target}"])

    if isinstance(message, re.Pattern):
        assert message.fullmatch(str(caught.value)), str(caught.value)
    else:
        assert str(caught.value) == message


@pytest.mark.parametrize("target", ["Centered", "Itemized"])
def test_model_code_the_meta_device_cannot_run_passes_the_check_and_trains(faulty_nets, tmp_path, target):
    """Centered uses a tensor its module made on import; Itemized reads a value (.item())."""
    check_command_line([*SMALL, f"model.target=faulty_nets:{target}"])

    metrics = Trainer(
        compose_config(f"model.target=faulty_nets:{target}", "max_steps=1"), tmp_path / "run"
    ).fit()

    assert metrics["status"] == "completed" and metrics["flops_per_image"] is None


def test_a_model_that_does_not_fit_stops_the_trainer_before_any_file(faulty_nets, tmp_path):
    """From Python there is no command-line check: the Trainer's own build says it, before any
    checkpoint, log or TensorBoard file (metrics.json records the failure)."""
    with pytest.raises(ConfigError) as caught:
        Trainer(compose_config("model.target=faulty_nets:seven_classes"), tmp_path / "run").fit()

    assert str(caught.value).startswith("model.target=faulty_nets:seven_classes: a (2, 3, 32, 32) batch")
    assert sorted(path.name for path in (tmp_path / "run").iterdir()) == ["metrics.json"]


# ---------------------------------------------------------------- settings that cannot act


def config(*overrides: str):
    return to_train_config(compose_config(*overrides))


DDP_TOGGLE_FAULTS = {
    "comm-hook-without-ddp": (
        ("ddp_comm_hook=bf16",),
        [
            "ddp_comm_hook=bf16 has no effect here (ddp=false: no DistributedDataParallel); "
            "carrying on without it"
        ],
    ),
    "several-without-ddp": (
        ("ddp_backend=gloo", "ddp_bucket_cap_mb=100", "ddp_static_graph=true"),
        [
            "ddp_backend=gloo / ddp_bucket_cap_mb=100 / ddp_static_graph=true has no effect here "
            "(ddp=false: no DistributedDataParallel); carrying on without it"
        ],
    ),
    "one-ddp-process": (
        ("ddp=true", "devices=1", "ddp_max_restarts=1", "ddp_gradient_as_bucket_view=true"),
        [
            "ddp_gradient_as_bucket_view=true has no effect here (one process: nothing to all-reduce); "
            "carrying on without it"
        ],
    ),
    "defaults": ((), []),
}


def test_wrapper_toggles_beside_after_backward_say_so_once(caplog):
    caplog.set_level(logging.INFO, logger="trainer.perf")
    overrides = (
        "ddp=true",
        "devices=2",
        "ddp_sync=after_backward",
        "ddp_comm_hook=bf16",
        "ddp_max_restarts=1",
    )
    unused_ddp_toggles(config(*overrides), world_size=2)

    assert [record.getMessage() for record in caplog.records] == [
        "ddp_comm_hook=bf16 has no effect here (ddp_sync=after_backward: no DistributedDataParallel to "
        "configure); carrying on without it"
    ]


@pytest.mark.parametrize(("overrides", "lines"), DDP_TOGGLE_FAULTS.values(), ids=DDP_TOGGLE_FAULTS.keys())
def test_ddp_toggles_without_distributed_data_parallel_say_so_once(caplog, overrides, lines):
    caplog.set_level(logging.INFO, logger="trainer.perf")
    unused_ddp_toggles(config(*overrides), world_size=1)

    assert [record.getMessage() for record in caplog.records] == lines


def test_a_trainer_says_it_once(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trainer.perf")
    Trainer(compose_config("ddp_comm_hook=powersgd", "max_steps=1"), tmp_path / "run").fit()

    assert caplog.text.count("ddp_comm_hook=powersgd has no effect here") == 1


LR_FAULTS = {
    "base-batch-1e12": (
        ("optim.lr_base_batch=1000000000000",),
        [
            "optim.lr_base_batch=1000000000000 scales optim.lr=0.02 down to a peak lr of 6.4e-13 at this "
            "run's global batch (linear scaling): the weights will hardly change; give optim.lr for a batch "
            "near the run's, e.g. optim.lr_base_batch=128"
        ],
    ),
    "adamw-base-batch-1e15": (
        ("optim=adamw", "optim.lr_base_batch=1000000000000000"),
        [
            "optim.lr_base_batch=1000000000000000 scales optim.lr=0.001 down to a peak lr of 1.79e-10 "
            "at this run's global batch (sqrt scaling): the weights will hardly change; give optim.lr for "
            "a batch near the run's, e.g. optim.lr_base_batch=128"
        ],
    ),
    "lr-1e-9": (
        ("optim.lr=1e-9",),
        [
            "peak lr 2.5e-10 (optim.lr=1e-09, optim.lr_base_batch=128): the weights will hardly change; "
            "set e.g. optim.lr=0.05"
        ],
    ),
    "lr-0": (
        ("optim.lr=0",),
        ["optim.lr=0: the weights will not change; set e.g. optim.lr=0.05 to train"],
    ),
    "batch-1": (("batch_size=1",), []),  # 1/128 of the base batch: small, meant
}


@pytest.mark.parametrize(("overrides", "lines"), LR_FAULTS.values(), ids=LR_FAULTS.keys())
def test_a_vanishing_peak_lr_is_a_warning_naming_its_cause(caplog, overrides, lines):
    cfg = config(*overrides)
    build_optimizer(cfg.optim, nn.Linear(2, 2), {}, peak_lr(cfg.optim, cfg.batch_size))

    assert [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING] == lines


PROFILE_STEPS = """
import torch
from trainer.perf import Profiler
profiler = Profiler(True, {trace_dir!r}, warmup_steps=1, active_steps=1)
for _ in range(3):
    torch.ones(8, 8) @ torch.ones(8, 8)
    profiler.step()
profiler.stop()
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="kineto's GPU query fails only where there is no GPU")
def test_the_profiler_on_a_cpu_prints_no_gpu_errors(tmp_path):
    environment = cli_environment()
    environment.pop("KINETO_LOG_LEVEL", None)
    code = PROFILE_STEPS.format(trace_dir=str(tmp_path / "profile"))

    result = subprocess.run(
        [sys.executable, "-c", code], env=environment, capture_output=True, text=True, timeout=HANG_GUARD_S
    )

    assert result.returncode == 0, result.stderr
    assert "ERROR" not in result.stderr and "gpuGetDeviceCount" not in result.stderr
    assert list((tmp_path / "profile").glob("*.pt.trace.json"))
