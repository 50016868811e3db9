"""model.target=module:callable: the user's own model, imported, built and checked, each failure
one ConfigError naming model.target, the user's message and the line of the user's code it
came from.

Must not touch: the built-in models and what every model gets after its build (trainer/models.py).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import traceback
from collections.abc import Callable

import torch
from torch import nn

from trainer.config import ConfigError
from trainer.data.augment import IMAGE_SIZE


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
