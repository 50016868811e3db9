"""Optimizer and learning-rate schedule from the `optim` group."""

from __future__ import annotations

import logging

import torch
from torch import nn

from trainer.config import OptimConfig, OptimizerName, Schedule

log = logging.getLogger(__name__)

# torch's OneCycleLR rises until step `pct_start * total_steps - 1` and divides by the length
# of that rise: a rise that ends exactly at step 0 (0.2 of 5 steps, 0.5 of 2) is 0 / 0. Ending
# it this little before step 0 is the same schedule: the first step at the peak, then the anneal.
BEFORE_FIRST_STEP = 1e-9


def build_optimizer(cfg: OptimConfig, model: nn.Module, extra: dict) -> torch.optim.Optimizer:
    """`extra` carries perf toggles (fused kernels) decided in perf.py."""
    if cfg.lr == 0:
        log.warning("optim.lr=0: the weights will not change; set e.g. optim.lr=0.05 to train")
    params = model.parameters()
    if cfg.name is OptimizerName.adamw:
        return torch.optim.AdamW(
            params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, **extra
        )
    return torch.optim.SGD(
        params,
        lr=cfg.lr,
        momentum=cfg.momentum,
        nesterov=cfg.nesterov,
        weight_decay=cfg.weight_decay,
        **extra,
    )


def constant(_step: int) -> float:
    return 1.0


def onecycle_pct_start(warmup_frac: float, total_steps: int) -> float:
    """warmup_frac, unless its rise would end exactly at step 0 (see BEFORE_FIRST_STEP)."""
    if warmup_frac * total_steps - 1 == 0:
        return (1 - BEFORE_FIRST_STEP) / total_steps
    return warmup_frac


def build_scheduler(cfg: OptimConfig, optimizer: torch.optim.Optimizer, total_steps: int):
    """Stepped once per optimizer step; any total_steps of 1 or more works with every schedule."""
    if cfg.schedule is Schedule.onecycle:
        pct_start = onecycle_pct_start(cfg.warmup_frac, total_steps)
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=cfg.lr, total_steps=total_steps, pct_start=pct_start
        )
    if cfg.schedule is Schedule.cosine:
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, constant)
