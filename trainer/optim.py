"""Optimizer and learning-rate schedule from the `optim` group."""

from __future__ import annotations

import torch
from torch import nn

from trainer.config import OptimConfig, OptimizerName, Schedule


def build_optimizer(cfg: OptimConfig, model: nn.Module, extra: dict) -> torch.optim.Optimizer:
    """`extra` carries perf toggles (fused kernels) decided in perf.py."""
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


def build_scheduler(cfg: OptimConfig, optimizer: torch.optim.Optimizer, total_steps: int):
    """Stepped once per optimizer step."""
    if cfg.schedule is Schedule.onecycle:
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=cfg.lr, total_steps=total_steps, pct_start=cfg.warmup_frac
        )
    if cfg.schedule is Schedule.cosine:
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, constant)
