"""Progressive resizing (data.low_res) and ResNet-18's zero-initialized residual blocks take
effect, and bad combinations cost one line (CPU)."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import compose_config
from torch import nn

from trainer import Trainer
from trainer.config import ConfigError, ModelConfig, ModelName, to_train_config
from trainer.data.resolution import downscale
from trainer.models import build_model

LOW_RES = ("model=fastcnn", "data.train_size=64", "data.test_size=32", "epochs=2", "data.low_res=16")


def test_the_first_epochs_train_on_small_images_and_the_warm_up_sees_both_sizes(tmp_path):
    trainer = Trainer(compose_config(*LOW_RES, "data.low_res_epochs=1"), tmp_path / "run").build()
    trainer.warm_up_steps = 1  # as with compile: one step at each size the run will train at
    seen = []

    def record(module, args):
        seen.append(("train" if module.training else "eval", args[0].shape[-1]))

    first_conv = next(m for m in trainer.raw_model.modules() if isinstance(m, nn.Conv2d))
    first_conv.register_forward_pre_hook(record)
    trainer.fit()
    training = [size for mode, size in seen if mode == "train"]
    assert training == [16, 32] + [16, 16] + [32, 32]  # warm-up, epoch 1 (low res), epoch 2
    assert {size for mode, size in seen if mode == "eval"} == {32}  # evaluation at full size


def test_downscaling_keeps_the_memory_format_and_a_flat_image_flat():
    images = torch.full((2, 3, 32, 32), 0.5).contiguous(memory_format=torch.channels_last)
    small = downscale(images, 24)
    assert small.shape == (2, 3, 24, 24)
    assert small.is_contiguous(memory_format=torch.channels_last) and not small.is_contiguous()
    torch.testing.assert_close(small, torch.full_like(small, 0.5))
    assert downscale(torch.zeros(1, 3, 32, 32), 16).is_contiguous()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("data.low_res=40", "data.low_res_epochs=2"), "8 to 31 pixels, got 40"),
        (("data.low_res=24",), "set both"),
        (("data.low_res_epochs=3",), "set both"),
    ],
)
def test_bad_low_res_settings_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        to_train_config(compose_config(*overrides))


def test_a_model_that_needs_32x32_images_is_refused_before_training(tmp_path):
    with pytest.raises(ConfigError, match="cnn cannot take 24x24 images"):
        Trainer(compose_config("data.low_res=24", "data.low_res_epochs=1"), tmp_path / "run").build()


def test_zero_init_residual_elsewhere_says_once_that_it_cannot_act(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trainer")
    overrides = (*LOW_RES, "data.low_res_epochs=1", "model.zero_init_residual=true")
    Trainer(compose_config(*overrides), tmp_path).build()  # the model, its shape check, two FLOP counts
    said = [r.message for r in caplog.records if "zero_init_residual acts on resnet18 only" in r.message]
    assert said == ["model.zero_init_residual acts on resnet18 only: fastcnn is unchanged"]


def test_zero_init_residual_starts_every_block_as_the_identity():
    zeroed = build_model(ModelConfig(name=ModelName.resnet18, zero_init_residual=True), 10)
    plain = build_model(ModelConfig(name=ModelName.resnet18), 10)
    last_norms = [block.bn2.weight for block in zeroed.modules() if hasattr(block, "bn2")]
    assert len(last_norms) == 8 and all(torch.all(weight == 0) for weight in last_norms)
    assert all(torch.all(block.bn2.weight == 1) for block in plain.modules() if hasattr(block, "bn2"))
