"""An exponential moving average (EMA) of the weights, updated next to the optimizer step.

torch.optim.swa_utils.AveragedModel keeps the average. Two choices make it the model worth
evaluating on a short run:

- The decay warms up: update n uses min(decay, (1 + n) / (10 + n)), so the first updates
  follow the weights closely and the random initialization fades from the average within a
  few updates (with a fixed 0.98 it still held 70% of the weight after 18 updates).
- BatchNorm's running statistics are averaged with the same decay as the weights
  (use_buffers=True): they then describe the activations of weights like the average's.
  Copying the trained model's statistics instead paired the average with statistics of other
  weights and cost 14 points of test accuracy on full CIFAR-10.

Must not touch: when it updates (trainer/loop.py calls after_step), what is evaluated, saved
or exported (the loop and the run take `.module`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from trainer.config import EmaConfig

WARMUP_OFFSET = 10  # update n decays by at most (1 + n) / (WARMUP_OFFSET + n)


def warmed_up_decay(decay: float, updates: int) -> float:
    """The decay of the update that follows `updates` earlier ones."""
    return min(decay, (1 + updates) / (WARMUP_OFFSET + updates))


class WeightAverage:
    """average = d x average + (1 - d) x weights every `update_every` optimizer steps, where d
    is `decay` once warmed up; parameters and buffers alike, the first update a copy."""

    def __init__(self, model: nn.Module, decay: float, update_every: int):
        self.model, self.decay, self.update_every = model, decay, update_every
        self.updates = 0  # kept on the host: AveragedModel's own count lives on the device

        def blend(averaged: list[torch.Tensor], current: list[torch.Tensor], _updates) -> None:
            if not averaged[0].is_floating_point():  # BatchNorm's batch counts: the latest
                torch._foreach_copy_(averaged, current)
                return
            torch._foreach_lerp_(averaged, current, 1 - warmed_up_decay(self.decay, self.updates))

        self.average = AveragedModel(model, multi_avg_fn=blend, use_buffers=True)

    @property
    def module(self) -> nn.Module:
        return self.average.module

    @torch.no_grad()
    def after_step(self, step: int) -> None:
        if step % self.update_every == 0:
            self.average.update_parameters(self.model)
            self.updates += 1

    def state_dict(self) -> dict:
        return self.average.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.average.load_state_dict(state)
        self.updates = int(self.average.n_averaged)


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
