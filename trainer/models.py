"""Models by name: the tutorial CNN, torchvision's ResNet-18 with the CIFAR stem and a small
fast-training CIFAR net (fastcnn); or the user's own, from `model.target=module:callable`
(imported and checked in trainer/model_target.py).

A model with an `initialize_from_data(images)` method is handed the normalized training images
(a few thousand) once, after it is built and before training: fastcnn sets its whitening conv so.

Must not touch: device, memory format, wrapping and compiling (trainer/perf/model.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainer.config import ConfigError, ModelConfig, ModelName
from trainer.data import Normalizer
from trainer.fastcnn import WHITENING_IMAGES, fastcnn
from trainer.model_target import DRY_RUN_IMAGES, build_target, check_target

log = logging.getLogger(__name__)


def cnn(num_classes: int, conv_bias: bool = True) -> nn.Module:
    """The classic tutorial CNN: conv-ReLU-pool x3 (32/64/128 channels), fc 512, fc num_classes.

    It has no BatchNorm, so its convs keep their bias whatever `conv_bias` says.
    """

    def block(in_channels: int, out_channels: int) -> list[nn.Module]:
        return [
            nn.Conv2d(in_channels, out_channels, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        ]

    return nn.Sequential(
        *block(3, 32),
        *block(32, 64),
        *block(64, 128),
        nn.Flatten(),
        nn.Linear(128 * 4 * 4, 512),
        nn.ReLU(inplace=True),
        nn.Linear(512, num_classes),
    )


def resnet18(num_classes: int, conv_bias: bool = True, zero_init_residual: bool = False) -> nn.Module:
    """torchvision's ResNet-18 with the CIFAR stem: 3x3 stride-1 first conv, no max-pool.

    conv_bias=True gives every conv a bias, as a plain nn.Conv2d has; every conv here is
    followed by BatchNorm, which cancels it, so conv_bias=False (torchvision's own choice)
    saves the work. zero_init_residual is torchvision's (Goyal et al. 2017): each residual
    block starts as the identity.
    """
    import torchvision  # imported where used: see trainer/data/sources/cifar10.py

    model = torchvision.models.resnet18(num_classes=num_classes, zero_init_residual=zero_init_residual)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    if conv_bias:
        # torchvision builds every conv without bias; the plain-loop baseline keeps one.
        for module in model.modules():
            if isinstance(module, nn.Conv2d):
                module.bias = nn.Parameter(torch.zeros(module.out_channels))
    return model


class CheckpointedStage(nn.Sequential):
    """A residual stage run under activation checkpointing: its activations are recomputed
    in backward. Same children as the plain stage, so checkpoints load either way."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return super().forward(x)
        return checkpoint(super().forward, x, use_reentrant=False)


RESIDUAL_STAGES = ("layer1", "layer2", "layer3", "layer4")


def checkpoint_stages(model: nn.Module) -> nn.Module:
    for name in RESIDUAL_STAGES:
        if hasattr(model, name):  # fastcnn has three
            setattr(model, name, CheckpointedStage(*getattr(model, name)))
    return model


BUILDERS: dict[ModelName, Callable[..., nn.Module]] = {
    ModelName.cnn: cnn,
    ModelName.resnet18: resnet18,
    ModelName.fastcnn: fastcnn,
}
# What a built-in model's build imports beyond torch and the trainer, for a server that forks
# runs to import once (trainer/forkserver.py): torchvision took 0.15-0.32 s of each forked
# ResNet-18 trial's set-up on one H200.
BUILD_IMPORTS: dict[ModelName, tuple[str, ...]] = {ModelName.resnet18: ("torchvision",)}


def build_imports(cfg: ModelConfig) -> tuple[str, ...]:
    return () if cfg.target else BUILD_IMPORTS.get(cfg.name, ())


def shapes_only(cfg: ModelConfig) -> ModelConfig:
    """The config of a throwaway meta-device copy (FLOP counts, shape checks): the options that
    change neither its shapes nor its counted FLOPs left at their defaults, so that building it
    logs none of their "acts on ... only" lines a second time."""
    return dataclasses.replace(cfg, grad_checkpointing=False, conv_bias=True, zero_init_residual=False)


def check_low_res(cfg: ModelConfig, num_classes: int, size: int) -> None:
    """The model takes size x size images (data.low_res), checked on a meta-device copy before
    anything is trained: a head sized for 32x32 (the tutorial cnn's) cannot."""
    with torch.device("meta"), torch.no_grad(), torch.random.fork_rng(devices=[]):
        model = build_model(shapes_only(cfg), num_classes)
        try:
            model(torch.zeros(DRY_RUN_IMAGES, 3, size, size))
        except Exception as error:  # any failure of the forward pass is the answer
            name = cfg.target or cfg.name.value
            raise ConfigError(
                f"data.low_res={size}: {name} cannot take {size}x{size} images ({type(error).__name__}: "
                f"{str(error).splitlines()[0][:160]}): set data.low_res=0, or use a model that pools "
                "to a fixed size before its classifier (resnet18, fastcnn)"
            ) from None


def initialize_from_data(model: nn.Module, split, device: torch.device) -> float:
    """Hand a model with `initialize_from_data` its normalized training images (the first few
    thousand; on the run's device where it is CUDA, on the CPU otherwise), once, before training.
    Returns the seconds it took: metrics.json's init_s, a part of training that time_to_target_s
    counts (as the published fast-CIFAR scripts count their whitening in their clocks)."""
    if not hasattr(model, "initialize_from_data"):
        return 0.0
    if split.images is None:
        log.warning(
            "%s cannot see the training images (decoded file by file each epoch): it keeps its "
            "default initialization. Set data.decode=once to initialize it from the data",
            type(model).__name__,
        )
        return 0.0
    where = device if device.type == "cuda" else torch.device("cpu")
    if where.type == "cuda":  # CUDA's context and cuBLAS's handle before the clock, as for a step
        warm = torch.ones(2, 2, dtype=torch.float64, device=where)
        warm = warm @ warm
        torch.cuda.synchronize(where)
    started = time.perf_counter()
    model.initialize_from_data(Normalizer(where)(split.images[:WHITENING_IMAGES].to(where)))
    if where.type == "cuda":
        torch.cuda.synchronize(where)
    return time.perf_counter() - started


def build_model(cfg: ModelConfig, num_classes: int) -> nn.Module:
    if cfg.target:
        if cfg.grad_checkpointing or not cfg.conv_bias or cfg.zero_init_residual:
            log.info(
                "model.target=%s: model.grad_checkpointing, model.conv_bias and model.zero_init_residual "
                "act on the built-in models only",
                cfg.target,
            )
        check_target(cfg.target, num_classes)
        return build_target(cfg.target, num_classes)
    only_resnet18 = {"zero_init_residual": cfg.zero_init_residual} if cfg.name is ModelName.resnet18 else {}
    if cfg.zero_init_residual and not only_resnet18:
        log.info("model.zero_init_residual acts on resnet18 only: %s is unchanged", cfg.name.value)
    model = BUILDERS[cfg.name](num_classes, conv_bias=cfg.conv_bias, **only_resnet18)
    if cfg.name is ModelName.cnn and (cfg.grad_checkpointing or not cfg.conv_bias):
        log.info(
            "cnn has no residual stages and no BatchNorm: model.grad_checkpointing and "
            "model.conv_bias leave it unchanged"
        )
    elif cfg.grad_checkpointing:
        model = checkpoint_stages(model)
    return model
