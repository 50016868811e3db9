"""MFU: FLOPs per training image counted once per model, the peak table, and where the
numbers land (metrics.json, the epoch records)."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import compose_config, read_metrics

from trainer import Trainer, mfu
from trainer.config import to_train_config
from trainer.progress import Progress

# The cnn by hand, in multiply-adds per image (3x3 convs at 32, 16 and 8 pixels, then two fc):
CNN_FORWARD_MACS = (
    32 * 32 * 32 * 3 * 9  # conv 3->32
    + 16 * 16 * 64 * 32 * 9  # conv 32->64
    + 8 * 8 * 128 * 64 * 9  # conv 64->128
    + 2048 * 512  # fc
    + 512 * 10  # fc
)
# Backward: a weight gradient for every layer, an input gradient for all but the first
# conv (the images need none); 2 FLOPs per multiply-add.
CNN_FIRST_CONV_MACS = 32 * 32 * 32 * 3 * 9
CNN_FLOPS_PER_IMAGE = 2 * (3 * CNN_FORWARD_MACS - CNN_FIRST_CONV_MACS)


def test_flops_per_image_match_the_hand_count():
    cnn = to_train_config(compose_config("model=cnn")).model
    resnet18 = to_train_config(compose_config("model=resnet18", "model.grad_checkpointing=true")).model

    assert mfu.flops_per_image(cnn, 10, (32, 3, 32, 32)) == CNN_FLOPS_PER_IMAGE == 66_484_224
    # ResNet-18 with the CIFAR stem: 3.33 GFLOP per training image; recomputation not counted.
    assert mfu.flops_per_image(resnet18, 10, (8, 3, 32, 32)) == 3_328_997_376
    # counted as first counted with batch norm's layers in place: the same at every image size
    fastcnn = to_train_config(compose_config("model=fastcnn")).model
    assert mfu.flops_per_image(resnet18, 10, (8, 3, 24, 24)) == 1_872_574_464
    assert mfu.flops_per_image(fastcnn, 10, (8, 3, 32, 32)) == 707_777_088
    assert mfu.flops_per_image(fastcnn, 10, (8, 3, 24, 24)) == 369_116_736


@pytest.mark.parametrize(
    ("device_name", "precision", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989),
        ("NVIDIA H200", "tf32", 494),
        ("NVIDIA H100 PCIe", "bf16", 756),
        ("NVIDIA A100-SXM4-80GB", "fp32", 19.5),
        ("NVIDIA GeForce RTX 4090", "bf16", None),
    ],
)
def test_peak_by_device_name_and_precision(device_name, precision, tflops):
    assert mfu.peak_tflops(device_name, precision) == tflops


@pytest.mark.parametrize(
    ("overrides", "precision"),
    [
        ([], "fp32"),
        (["tf32=true"], "tf32"),
        (["amp=true", "amp_dtype=fp16"], "fp16"),
        (["amp=true", "amp_dtype=bf16", "tf32=true"], "bf16"),
    ],
)
def test_precision_is_what_the_matmuls_run_in(overrides, precision):
    assert mfu.precision(to_train_config(compose_config(*overrides)), torch.device("cuda")) == precision


def test_utilization_is_the_share_of_the_peak():
    meter = mfu.Meter(flops_per_image=1e9, peak_flops=2 * 989e12)  # two devices

    assert meter.utilization(989e3) == pytest.approx(0.5)
    assert mfu.Meter(flops_per_image=1e9).utilization(989e3) is None  # unknown peak


def test_low_res_epochs_count_the_flops_of_their_own_image_size(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    cfg = to_train_config(compose_config("model=resnet18", "data.low_res=16", "data.low_res_epochs=2"))
    meter = mfu.meter(cfg, torch.device("cuda"), 10, (8, 3, 32, 32), world_size=1)
    assert meter.low_res_flops_per_image == pytest.approx(
        meter.flops_per_image / 4, rel=0.02
    )  # 1/4 the pixels
    full, small = meter.utilization(1e4, epoch=2), meter.utilization(1e4, epoch=1)
    assert small == pytest.approx(full * meter.low_res_flops_per_image / meter.flops_per_image)
    assert meter.utilization(1e4) == full  # no epoch: full size
    # the run's mfu weights each epoch by its seconds, over the epochs its img_per_s counts
    progress = Progress()
    for epoch_s, used in ((9.0, 0.9), (1.0, 0.2), (3.0, 0.4)):  # the first: warm-up, left out
        progress.add_epoch({"epoch_s": epoch_s, "img_per_s": 1.0, "data_wait_frac": None, "mfu": used,
                            "peak_mem_mb": None, "train_loss": 0.0})  # fmt: skip
    assert progress.summary()["mfu"] == pytest.approx((0.2 * 1.0 + 0.4 * 3.0) / 4.0)


def test_a_cpu_run_reports_flops_and_says_once_that_mfu_is_unknown(tmp_path, caplog):
    with caplog.at_level(logging.DEBUG, logger="trainer"):
        Trainer(compose_config("model=cnn", "data.train_size=64", "data.test_size=32"), tmp_path).fit()

    metrics = read_metrics(tmp_path)
    assert metrics["flops_per_image"] == CNN_FLOPS_PER_IMAGE
    assert "mfu" in metrics and metrics["mfu"] is None
    assert [record["mfu"] for record in metrics["history"]] == [None]
    assert [(r.levelno, r.message) for r in caplog.records if "MFU" in r.message] == [
        (logging.INFO, "MFU not reported: no peak FLOP/s is known for cpu devices (mfu is null)")
    ]
    epoch_lines = [
        r.message for r in caplog.records if r.name == "trainer.run" and r.message.startswith("epoch ")
    ]
    assert epoch_lines and all(" | mfu - | " in line for line in epoch_lines)
