"""Models by name: the tutorial CNN, torchvision's ResNet-18 with the CIFAR stem and a small
fast-training CIFAR net (fastcnn); or the user's own, from `model.target=module:callable`.

A model with an `initialize_from_data(images)` method is handed the normalized training images
(a few thousand) once, after it is built and before training: fastcnn sets its whitening conv so.

Must not touch: device, memory format, wrapping and compiling (trainer/perf/model.py).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainer.config import ConfigError, ModelConfig, ModelName
from trainer.data import Normalizer
from trainer.data.augment import IMAGE_SIZE
from trainer.fastcnn import WHITENING_IMAGES, fastcnn

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


def import_target(target: str) -> Callable[[int], nn.Module]:
    """The callable named by model.target ('module:callable')."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"model.target={target} is not module:callable: set model.target=mypkg.nets:MyNet")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # ImportError, or whatever the module raised while loading
        why = f"{type(error).__name__}: {str(error).splitlines()[0]}" if str(error) else type(error).__name__
        raise ConfigError(
            f"model.target={target}: cannot import {module_name} ({why}): install it, "
            "or add its folder to PYTHONPATH"
        ) from None
    builder = getattr(module, attribute, None)
    if not callable(builder):
        raise ConfigError(
            f"model.target={target}: {module_name} has no callable '{attribute}': "
            f"set model.target={module_name}:<a class or function in it>"
        )
    return builder


def build_target(target: str, num_classes: int, builder: Callable | None = None) -> nn.Module:
    """model.target called with the number of classes; anything its code raises comes back as
    one ConfigError naming model.target, the user's message and where it was raised."""
    builder = builder or import_target(target)
    name = target.partition(":")[2]
    try:
        inspect.signature(builder).bind(num_classes)
    except TypeError:
        raise ConfigError(
            f"model.target={target}: {name}{inspect.signature(builder)} cannot be called with the number "
            f"of classes alone: define it as {name}(num_classes) returning a torch.nn.Module"
        ) from None
    except ValueError:
        pass  # no signature to read (a builtin): the call itself says
    try:
        model = builder(num_classes)
    except Exception as error:
        raise user_code_error(target, f"{name}({num_classes})", error) from None
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model.target={target} returned a {type(model).__name__}, not a torch.nn.Module: "
            f"make {name}(num_classes) return one"
        )
    if torch.get_default_device().type != "meta":  # built for real: no tensor may be left on meta
        state = model.state_dict().items()
        on_meta = [key for key, tensor in state if isinstance(tensor, torch.Tensor) and tensor.is_meta]
        if on_meta:
            more = f" and {len(on_meta) - 1} more" if len(on_meta) > 1 else ""
            raise ConfigError(
                f"model.target={target}: {on_meta[0]}{more} of the model {name}({num_classes}) returned "
                "are on the meta device, which holds no values to train: create the model's tensors "
                "on the CPU (no device='meta', no empty-weight initialization)"
            )
    return model


def user_code_error(target: str, call: str, error: Exception) -> ConfigError:
    """An exception from the user's model code as one line: the call, the exception, and the
    last line of the user's own files that it passed through."""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    message = f"{type(error).__name__}: {first_line}" if first_line else type(error).__name__
    files = user_files(target)
    frames = [
        frame for frame in traceback.extract_tb(error.__traceback__) if frame.filename.startswith(files)
    ]
    where = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if files and frames else ""
    return ConfigError(
        f"model.target={target}: {call} raised {message}{where}: fix the model's code, "
        "or train a built-in model with model.target=null"
    )


def user_files(target: str) -> str:
    """The file of model.target's top-level module, or its folder (with a separator) for a package."""
    top = sys.modules.get(target.partition(":")[0].split(".")[0])
    file = getattr(top, "__file__", None) or ""
    return os.path.dirname(file) + os.sep if os.path.basename(file) == "__init__.py" else file


DRY_RUN_IMAGES = 2  # BatchNorm in training mode needs two values per channel


def dry_run(target: str, builder: Callable, num_classes: int) -> None:
    """Build model.target and forward a batch of images through it in training mode, as the
    training step will: it must take (N, 3, 32, 32) and give (N, num_classes) logits."""
    model = build_target(target, num_classes, builder)
    images = torch.zeros(DRY_RUN_IMAGES, 3, IMAGE_SIZE, IMAGE_SIZE)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            logits = model(images)
    except Exception as error:
        raise user_code_error(target, f"its forward pass of a {tuple(images.shape)} batch", error) from None
    expected = (DRY_RUN_IMAGES, num_classes)
    is_tensor = isinstance(logits, torch.Tensor)
    got = f"shape {tuple(logits.shape)}" if is_tensor else f"a {type(logits).__name__}"
    if not is_tensor or tuple(logits.shape) != expected:
        raise ConfigError(
            f"model.target={target}: a {tuple(images.shape)} batch of images gave {got}, not logits of "
            f"shape {expected} (images, classes): make {target.partition(':')[2]}(num_classes) return "
            "a model whose forward gives one logit per class"
        )


def check_target(target: str, num_classes: int = 10) -> None:
    """Build model.target and forward a batch through it before anything else is built, on a
    copy that is thrown away: on the meta device (shapes only: no memory, no arithmetic) and,
    where that fails, once more on the CPU, whose verdict stands (code the meta device cannot
    run: weights read from a file, a data-dependent op); where it passes, built on the CPU
    without a forward pass, to find tensors left on the meta device. The command line checks with CIFAR-10's
    10 classes; build_model checks again with the dataset's count (an image folder's may differ)."""
    builder = import_target(target)  # outside the meta device: the module's own tensors stay real
    try:
        with torch.device("meta"):
            dry_run(target, builder, num_classes)
    except ConfigError:
        dry_run(target, builder, num_classes)
    else:
        # built once more on the CPU, without a forward pass: tensors the target itself put on
        # the meta device look like every other there, and would fail only at model.to(device)
        build_target(target, num_classes, builder)


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
