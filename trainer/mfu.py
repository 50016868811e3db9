"""Model FLOPs utilization (MFU): the share of the devices' peak FLOP/s that the model's own
arithmetic uses, images/s x FLOPs per training image / (peak per device x devices).

FLOPs per image are counted once per run by torch.utils.flop_counter, forward and backward
at the run's batch shape, on a copy of the model built on the meta device: shapes only, so
no memory, no arithmetic and the real model untouched. The copy has no activation
checkpointing: its recomputation is work the hardware does, not work the model needs.

Must not touch: the model that trains, the loop (it only turns images/s into a fraction).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm  # every batch norm: 1d-3d, Sync, Lazy
from torch.utils.flop_counter import FlopCounterMode

from trainer import perf
from trainer.config import ModelConfig, TrainConfig
from trainer.models import build_model, shapes_only

log = logging.getLogger(__name__)

# Dense peak TFLOP/s per GPU (the datasheets' figures without 2:4 sparsity, which double them),
# by the precision the matmuls and convolutions run in. Sources: NVIDIA H100 Tensor Core GPU
# datasheet (SXM5, PCIe, NVL columns), NVIDIA H200 datasheet (SXM, NVL), NVIDIA A100
# datasheet (SXM4 and PCIe alike). fp32 is the CUDA-core figure, not a Tensor Core one.
# First row whose name appears in torch.cuda.get_device_name() wins.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H100 PCIe", {"bf16": 756, "fp16": 756, "tf32": 378, "fp32": 51}),
    ("H100 NVL", {"bf16": 835, "fp16": 835, "tf32": 417, "fp32": 60}),
    ("H200 NVL", {"bf16": 835, "fp16": 835, "tf32": 417, "fp32": 60}),
    ("H100", {"bf16": 989, "fp16": 989, "tf32": 494, "fp32": 67}),  # SXM5
    ("H200", {"bf16": 989, "fp16": 989, "tf32": 494, "fp32": 67}),  # SXM
    ("A100", {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5}),
]


@dataclass(frozen=True)
class Meter:
    flops_per_image: float | None = None  # forward + backward, one training image
    peak_flops: float | None = None  # FLOP/s of all the run's devices together; None: unknown
    low_res_flops_per_image: float | None = None  # the same at data.low_res, in its epochs
    low_res_epochs: int = 0

    def utilization(self, images_per_s: float | None, epoch: int = -1) -> float | None:
        """A fraction (0.25 is 25%) in this epoch (0-based; -1: one at full size), or None
        where the peak is unknown."""
        flops = self.low_res_flops_per_image if 0 <= epoch < self.low_res_epochs else self.flops_per_image
        if self.peak_flops is None or flops is None or images_per_s is None:
            return None
        return images_per_s * flops / self.peak_flops


def flops_per_image(model_cfg: ModelConfig, num_classes: int, batch_shape: tuple[int, ...]) -> float | None:
    """Forward + backward FLOPs per image of the model, at this batch shape; None for a
    model.target whose code the meta device cannot run (it trains on a real device all the same)."""
    plain = shapes_only(model_cfg)  # no checkpointing's recomputation; a conv bias is not counted
    try:
        with torch.device("meta"):
            model = build_model(plain, num_classes)
            images = torch.empty(batch_shape)
        if not model_cfg.target:  # a model of its own may reach into its batch norm's layers
            without_batch_norm(model)
        with FlopCounterMode(display=False) as counter:
            model(images).sum().backward()
    except Exception as error:
        if not model_cfg.target:
            raise
        log.info(
            "MFU not reported: the FLOPs of model.target=%s are counted on the meta device, where its "
            "code fails (%s)",
            model_cfg.target,
            str(error).splitlines()[0] if str(error) else type(error).__name__,
        )
        return None
    return counter.get_total_flops() / batch_shape[0]


def without_batch_norm(model: nn.Module) -> None:
    """Batch norm's layers replaced by identities. FlopCounterMode counts matmuls and
    convolutions only, and batch norm keeps its input's shape, so the count is the same
    (tests/test_mfu.py); running batch norm's decomposition on the meta device was most of the
    count's time (ResNet-18: 0.15-0.35 s of a count, against 0.05 s without, on the 2-core CPU)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, _BatchNorm):
                setattr(module, name, nn.Identity())


def precision(cfg: TrainConfig, device: torch.device) -> str:
    """What the matmuls and convolutions run in: the autocast dtype, else tf32 or fp32."""
    dtype = perf.amp_dtype(cfg, device)
    if dtype is not None:
        return "bf16" if dtype == torch.bfloat16 else "fp16"
    return "tf32" if cfg.tf32 else "fp32"


def peak_tflops(device_name: str, precision_name: str) -> float | None:
    for name, peaks in PEAK_TFLOPS:
        if name in device_name:
            return peaks[precision_name]
    return None


def meter(
    cfg: TrainConfig, device: torch.device, num_classes: int, batch_shape: tuple[int, ...], world_size: int
) -> Meter:
    """The run's MFU meter (FLOPs counted at the batch shape, and at data.low_res where set);
    where the device's peak is unknown, one log line says so."""
    flops = flops_per_image(cfg.model, num_classes, batch_shape)
    if cfg.data.low_res and flops is not None:
        small = flops_per_image(
            cfg.model, num_classes, (*batch_shape[:2], cfg.data.low_res, cfg.data.low_res)
        )
        counted = Meter(flops, low_res_flops_per_image=small, low_res_epochs=cfg.data.low_res_epochs)
    else:
        counted = Meter(flops)
    if device.type != "cuda":
        log.info("MFU not reported: no peak FLOP/s is known for %s devices (mfu is null)", device.type)
        return counted
    name, precision_name = torch.cuda.get_device_name(device), precision(cfg, device)
    tflops = peak_tflops(name, precision_name)
    if tflops is None:
        log.info(
            "MFU not reported: no peak FLOP/s known for %s in %s (mfu is null); trainer/mfu.py "
            "lists the known ones",
            name,
            precision_name,
        )
        return counted
    return dataclasses.replace(counted, peak_flops=tflops * 1e12 * world_size)
