"""An exponential moving average (EMA) of the weights, updated next to the optimizer step.

torch.optim.swa_utils.AveragedModel keeps the average of the parameters; BatchNorm's running
statistics are copied from the trained model at each update instead of averaged: they then
describe activations of weights close to the average's, and cost no extra pass over the data
(swa_utils.update_bn would recompute them exactly, at the price of an epoch of forward passes).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from trainer.config import EmaConfig


class WeightAverage:
    """average = decay x average + (1 - decay) x weights, every `update_every` optimizer steps;
    the first update copies the weights."""

    def __init__(self, model: nn.Module, decay: float, update_every: int):
        self.model, self.update_every = model, update_every
        self.average = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=False)

    @property
    def module(self) -> nn.Module:
        return self.average.module

    @torch.no_grad()
    def after_step(self, step: int) -> None:
        if step % self.update_every:
            return
        self.average.update_parameters(self.model)
        for averaged, trained in zip(self.average.module.buffers(), self.model.buffers()):
            averaged.copy_(trained)

    def state_dict(self) -> dict:
        return self.average.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.average.load_state_dict(state)


class NoAverage:
    """ema.enabled=false: the trained model is the one evaluated, saved and exported."""

    def __init__(self, model: nn.Module):
        self.module = model

    def after_step(self, step: int) -> None:
        pass


def weight_average(cfg: EmaConfig, model: nn.Module) -> WeightAverage | NoAverage:
    if cfg.enabled:
        return WeightAverage(model, cfg.decay, cfg.update_every)
    return NoAverage(model)
