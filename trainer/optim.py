"""Optimizer and learning-rate schedule from the `optim` group.

Owns: the optimizer and its parameter groups, the peak lr scaled to the global batch, the
schedules. Must not touch: stepping them (trainer/loop.py), the fused-kernel toggle
(trainer/perf/), the step budget they are built for (trainer/assembly.py)."""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable

import torch
from torch import nn

from trainer.config import ConfigError, LrScaling, OptimConfig, OptimizerName, Schedule
from trainer.muon import MuonWithSgd, build_muon_with_sgd

log = logging.getLogger(__name__)

# torch's OneCycleLR rises until step `pct_start * total_steps - 1` and divides by the length
# of that rise: a rise that ends exactly at step 0 (0.2 of 5 steps, 0.5 of 2) is 0 / 0. Ending
# it this little before step 0 is the same schedule: the first step at the peak, then the anneal.
BEFORE_FIRST_STEP = 1e-9


# A peak lr this far below optim.lr (lr_base_batch over 1000x the global batch with linear
# scaling, 10^6x with sqrt), or this small whatever the cause, hardly moves the weights: it is a
# slip such as optim.lr_base_batch=1e12, not a setting, and the run says so as it does for lr=0.
VANISHING_SCALE = 1e-3  # of optim.lr
VANISHING_LR = 1e-8


# lr_scaling=auto, by optimizer: SGD's update is proportional to the gradient, whose noise
# falls as 1/batch (linear, Goyal et al.); Adam's is normalized by the gradient's size, and the
# square root keeps its noise per update constant (Malladi et al.; timm's default for Adam-family).
AUTO_SCALING = {
    OptimizerName.sgd: LrScaling.linear,
    OptimizerName.muon: LrScaling.linear,  # optim.lr is sgd's there; optim.muon_lr is not scaled
    OptimizerName.adamw: LrScaling.sqrt,
}


def scaling_rule(cfg: OptimConfig) -> LrScaling:
    return AUTO_SCALING[cfg.name] if cfg.lr_scaling is LrScaling.auto else cfg.lr_scaling


def logged_peak_lr(cfg: OptimConfig, global_batch: int) -> float:
    """optim.lr scaled to the global batch, said in the run's log."""
    lr_peak = peak_lr(cfg, global_batch)
    rule, base = scaling_rule(cfg).value, cfg.lr_base_batch
    message = "peak lr %.4g: optim.lr=%g for optim.lr_base_batch=%d, scaled (%s) to the global batch %d"
    log.info(message, lr_peak, cfg.lr, base, rule, global_batch)
    return lr_peak


def peak_lr(cfg: OptimConfig, global_batch: int) -> float:
    """optim.lr, given for optim.lr_base_batch images, scaled to this global batch."""
    ratio = global_batch / cfg.lr_base_batch
    rule = scaling_rule(cfg)
    if rule is LrScaling.linear:
        return cfg.lr * ratio
    if rule is LrScaling.sqrt:
        return cfg.lr * math.sqrt(ratio)
    return cfg.lr


EARLY = "early"  # marks the parameter group of optim.early_epochs (build_scheduler reads it)


def parameter_groups(cfg: OptimConfig, model: nn.Module, lr: float) -> list[dict]:
    """The trainable parameters; BatchNorm shifts in a group of their own when
    optim.norm_bias_lr_scale is not 1; with optim.early_epochs, the model's early parameters
    in another, at the shifts' lr and weight decay."""
    trainable = [param for param in model.parameters() if param.requires_grad]
    early = early_parameters(cfg, model)
    shifted = {"lr": lr * cfg.norm_bias_lr_scale, "weight_decay": cfg.weight_decay / cfg.norm_bias_lr_scale}
    groups = [{"params": [param for param in trainable if id(param) not in early]}]
    if early:
        early_group = [param for param in trainable if id(param) in early]
        groups.append({"params": early_group, EARLY: True, **shifted})
    if cfg.norm_bias_lr_scale == 1:
        return groups
    norms = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.GroupNorm, nn.LayerNorm)
    shifts = {
        id(module.bias)
        for module in model.modules()
        if isinstance(module, norms) and module.bias is not None and module.bias.requires_grad
    }
    groups[0]["params"] = [param for param in groups[0]["params"] if id(param) not in shifts]
    return [*groups, {"params": [param for param in trainable if id(param) in shifts], **shifted}]


def early_parameters(cfg: OptimConfig, model: nn.Module) -> set[int]:
    """The ids of what the model's early_parameters() names, under optim.early_epochs."""
    if not cfg.early_epochs:
        return set()
    named = getattr(model, "early_parameters", None)
    params = [param for param in named() if param.requires_grad] if named else []
    if not params:
        raise ConfigError(
            f"optim.early_epochs={cfg.early_epochs}: the model names no early parameters to train "
            "only at the start (model=fastcnn does: its whitening conv's bias; a model of your own "
            "defines early_parameters()): set optim.early_epochs=0"
        )
    return {id(param) for param in params}


def build_optimizer(
    cfg: OptimConfig,
    model: nn.Module,
    extra: dict,
    lr: float,
    compiler: Callable[[Callable], Callable] | None = None,
    share: tuple[int, int] | None = None,
) -> torch.optim.Optimizer:
    """`lr`: the peak lr for this run's batch (`peak_lr`); `extra` carries perf toggles (fused
    kernels), `compiler` compile=true's torch.compile for optim=muon's arithmetic and `share`
    ddp_shard_muon's (rank, ranks), all decided in trainer/perf/."""
    if lr == 0:
        log.warning("optim.lr=0: the weights will not change; set e.g. optim.lr=0.05 to train")
    elif lr < VANISHING_SCALE * cfg.lr:
        log.warning(
            "optim.lr_base_batch=%d scales optim.lr=%g down to a peak lr of %.3g at this run's global "
            "batch (%s scaling): the weights will hardly change; give optim.lr for a batch near the "
            "run's, e.g. optim.lr_base_batch=128",
            cfg.lr_base_batch,
            cfg.lr,
            lr,
            scaling_rule(cfg).value,
        )
    elif lr < VANISHING_LR:
        log.warning(
            "peak lr %.3g (optim.lr=%g, optim.lr_base_batch=%d): the weights will hardly change; "
            "set e.g. optim.lr=0.05",
            lr,
            cfg.lr,
            cfg.lr_base_batch,
        )
    params = parameter_groups(cfg, model, lr)
    if cfg.name is OptimizerName.muon:
        return build_muon_with_sgd(cfg, model, params, lr, extra, compiler, share)
    if cfg.name is OptimizerName.adamw:
        return torch.optim.AdamW(
            params, lr=lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, **extra
        )
    return torch.optim.SGD(
        params,
        lr=lr,
        momentum=cfg.momentum,
        nesterov=cfg.nesterov,
        weight_decay=cfg.weight_decay,
        **extra,
    )


def constant(_step: int) -> float:
    return 1.0


def linear_warmup_decay(total_steps: int, warmup_frac: float, start_frac: float):
    """The lr factor of each step: start_frac rising in a straight line to 1 over warmup_frac of
    the steps, then falling in a straight line to 0 after the last step."""
    rise = max(1, round(warmup_frac * total_steps))

    def factor(step: int) -> float:
        if step < rise:
            return start_frac + (1 - start_frac) * step / rise
        return max(0.0, (total_steps - step) / max(1, total_steps - rise))

    return factor


def onecycle_pct_start(warmup_frac: float, total_steps: int) -> float:
    """warmup_frac, unless its rise would end exactly at step 0 (see BEFORE_FIRST_STEP)."""
    if warmup_frac * total_steps - 1 == 0:
        return (1 - BEFORE_FIRST_STEP) / total_steps
    return warmup_frac


def build_scheduler(
    cfg: OptimConfig, optimizer: torch.optim.Optimizer, total_steps: int, steps_per_epoch: int = 1
):
    """Stepped once per optimizer step; any total_steps of 1 or more works with every schedule.
    The peak is the lr the optimizer was built with. The group of optim.early_epochs falls in a
    straight line from its peak to 0 over those epochs, then stays at 0 (linear and constant)."""
    if cfg.schedule is Schedule.onecycle:
        pct_start = onecycle_pct_start(cfg.warmup_frac, total_steps)
        peaks = [group["lr"] for group in optimizer.param_groups]
        # OneCycleLR cycles every group's momentum between 0.85 and 0.95 (its defaults); Muon's
        # groups keep optim.muon_momentum
        muon = (
            {id(group) for group in optimizer.muon.param_groups}
            if isinstance(optimizer, MuonWithSgd)
            else set()
        )
        lows = [cfg.muon_momentum if id(group) in muon else 0.85 for group in optimizer.param_groups]
        highs = [cfg.muon_momentum if id(group) in muon else 0.95 for group in optimizer.param_groups]
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer,
            max_lr=peaks,
            total_steps=total_steps,
            pct_start=pct_start,
            base_momentum=lows,
            max_momentum=highs,
        )
    if cfg.schedule is Schedule.cosine:
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
    if cfg.schedule is Schedule.linear:
        factor = linear_warmup_decay(total_steps, cfg.warmup_frac, cfg.lr_start_frac)
    else:
        factor = constant
    early = functools.partial(falling_to_zero, max(1, cfg.early_epochs * steps_per_epoch))
    factors = [early if group.get(EARLY) else factor for group in optimizer.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factors)


def falling_to_zero(steps: int, step: int) -> float:
    """1 at step 0, falling in a straight line to 0 at `steps`, 0 after (optim.early_epochs)."""
    return max(0.0, 1 - step / steps)
