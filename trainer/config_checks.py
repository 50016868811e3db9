"""The schema's checks: what each dataclass of trainer/config.py refuses, and how the refusal
reads (the key, what it got, the fix in override syntax). Each runs from its dataclass's
__post_init__, so a composed config is checked as it becomes a TrainConfig, before anything
is built.

Owns: the rules that span a value's range or several fields. A new rule is a few lines in the
function of its dataclass, and a test that pins its message.
Must not touch: the fields and their defaults (trainer/config.py), torch.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from trainer.config_choices import CompileMode, DataSource, DecodeMode, LoaderKind, OptimizerName, Schedule
from trainer.errors import ConfigError

if TYPE_CHECKING:
    from trainer.config import DataConfig, EmaConfig, EvalConfig, OptimConfig, TrainConfig

MAX_SEED = 2**32 - 1  # numpy's generator takes seeds in [0, 2**32)


def check_data(cfg: DataConfig) -> None:
    # at most 16 also keeps data.padding_mode=reflect valid: torch's needs less than the image's 32
    if not 0 <= cfg.crop_padding <= 16:
        raise ConfigError(
            f"data.crop_padding must be 0 to 16 pixels, got {cfg.crop_padding}: set e.g. data.crop_padding=4"
        )
    if not 0 <= cfg.cutout <= 32:
        raise ConfigError(
            f"data.cutout must be 0 (off) to 32 pixels, got {cfg.cutout}: set e.g. data.cutout=12"
        )
    if cfg.low_res and not 8 <= cfg.low_res < 32:
        raise ConfigError(
            f"data.low_res must be 0 (off) or 8 to 31 pixels, got {cfg.low_res}: set e.g. data.low_res=24"
        )
    if cfg.low_res_epochs < 0 or bool(cfg.low_res) != bool(cfg.low_res_epochs):
        raise ConfigError(
            f"data.low_res={cfg.low_res} with data.low_res_epochs={cfg.low_res_epochs}: set both "
            "(e.g. data.low_res=24 data.low_res_epochs=10) or both to 0"
        )


def check_optim(cfg: OptimConfig) -> None:
    # Checked here, not left to torch, so that a bad value costs one line before any run folder exists.
    if not (math.isfinite(cfg.lr) and cfg.lr >= 0):
        raise ConfigError(f"optim.lr must be finite and not negative, got {cfg.lr}: set e.g. optim.lr=0.05")
    if not (math.isfinite(cfg.weight_decay) and cfg.weight_decay >= 0):
        raise ConfigError(
            f"optim.weight_decay must be 0 or more, got {cfg.weight_decay}: "
            "set optim.weight_decay=0 (none) or e.g. optim.weight_decay=5e-4"
        )
    if not 0.0 <= cfg.momentum < 1.0:
        raise ConfigError(
            f"optim.momentum must be in [0, 1), got {cfg.momentum}: "
            "set optim.momentum=0.9 (or optim.momentum=0 for none)"
        )
    if cfg.name is not OptimizerName.adamw and cfg.nesterov and cfg.momentum == 0:
        raise ConfigError(
            "optim.nesterov=true needs momentum: set optim.momentum=0.9 or optim.nesterov=false"
        )
    if len(cfg.betas) != 2 or not all(0.0 <= beta < 1.0 for beta in cfg.betas):
        raise ConfigError(
            f"optim.betas must be two numbers in [0, 1), got {list(cfg.betas)}: set optim.betas=[0.9,0.999]"
        )
    if not (math.isfinite(cfg.muon_lr) and cfg.muon_lr >= 0):
        raise ConfigError(
            f"optim.muon_lr must be finite and not negative, got {cfg.muon_lr}: set e.g. optim.muon_lr=0.02"
        )
    if not 0.0 <= cfg.muon_momentum < 1.0:
        raise ConfigError(
            f"optim.muon_momentum must be in [0, 1), got {cfg.muon_momentum}: set optim.muon_momentum=0.95"
        )
    if not (math.isfinite(cfg.muon_weight_decay) and cfg.muon_weight_decay >= 0):
        raise ConfigError(
            f"optim.muon_weight_decay must be 0 or more, got {cfg.muon_weight_decay}: "
            "set optim.muon_weight_decay=0"
        )
    if cfg.muon_ns_steps < 1:
        raise ConfigError(
            f"optim.muon_ns_steps must be 1 or more, got {cfg.muon_ns_steps}: set optim.muon_ns_steps=5"
        )
    if cfg.early_epochs < 0:
        raise ConfigError(
            f"optim.early_epochs must be 0 or more, got {cfg.early_epochs}: set optim.early_epochs=0"
        )
    if not 0.0 <= cfg.label_smoothing < 1.0:
        raise ConfigError(f"optim.label_smoothing must be in [0, 1), got {cfg.label_smoothing}")
    if not 0.0 < cfg.warmup_frac < 1.0:
        raise ConfigError(f"optim.warmup_frac must be in (0, 1), got {cfg.warmup_frac}")
    if not 0.0 <= cfg.lr_start_frac <= 1.0:
        raise ConfigError(f"optim.lr_start_frac must be in [0, 1], got {cfg.lr_start_frac}")
    if not (math.isfinite(cfg.norm_bias_lr_scale) and cfg.norm_bias_lr_scale > 0):
        raise ConfigError(
            f"optim.norm_bias_lr_scale must be above 0, got {cfg.norm_bias_lr_scale}: "
            "set optim.norm_bias_lr_scale=1"
        )
    if cfg.lr_base_batch < 1:
        raise ConfigError(
            f"optim.lr_base_batch must be at least 1, got {cfg.lr_base_batch}: set optim.lr_base_batch=128"
        )


def check_eval(cfg: EvalConfig) -> None:
    if cfg.from_epoch < 1:
        raise ConfigError(f"eval.from_epoch must be at least 1, got {cfg.from_epoch}: set eval.from_epoch=1")
    if not 0.0 < cfg.tta_unsure <= 1.0:
        raise ConfigError(
            f"eval.tta_unsure must be in (0, 1], got {cfg.tta_unsure}: set eval.tta_unsure=1 (every image) "
            "or e.g. eval.tta_unsure=0.25"
        )


def check_ema(cfg: EmaConfig) -> None:
    if not 0.0 <= cfg.decay < 1.0:
        raise ConfigError(f"ema.decay must be in [0, 1), got {cfg.decay}: set e.g. ema.decay=0.99")
    if cfg.update_every < 1:
        raise ConfigError(
            f"ema.update_every must be at least 1, got {cfg.update_every}: set ema.update_every=1"
        )


def check_train(cfg: TrainConfig) -> None:
    check_ranges(cfg)
    check_combinations(cfg)


def check_ranges(cfg: TrainConfig) -> None:
    """Each top-level number and name within what it may be."""
    positive = ("epochs", "batch_size", "eval_every", "grad_accum_steps", "log_every")
    for name in positive:
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{name} must be at least 1, got {getattr(cfg, name)}: set {name}=1 or more")
    if cfg.max_steps is not None and cfg.max_steps < 1:
        raise ConfigError(f"max_steps must be null or at least 1, got {cfg.max_steps}")
    workers = cfg.num_workers
    if workers != "auto" and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 0):
        raise ConfigError(
            f"num_workers must be auto or a whole number >= 0, got {cfg.num_workers!r}: "
            "set num_workers=auto or num_workers=4"
        )
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", cfg.device):
        raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got '{cfg.device}'")
    if cfg.num_workers == 0 and (cfg.persistent_workers or cfg.prefetch_factor is not None):
        raise ConfigError(
            "persistent_workers and prefetch_factor need worker processes: set num_workers=2 "
            "(or more), or drop them"
        )
    if cfg.prefetch_factor is not None and cfg.prefetch_factor < 1:
        raise ConfigError(f"prefetch_factor must be null or at least 1, got {cfg.prefetch_factor}")
    if cfg.devices is not None and cfg.devices < 1:
        raise ConfigError(f"devices must be null or at least 1, got {cfg.devices}")
    if cfg.ddp_max_restarts < 0:
        raise ConfigError(f"ddp_max_restarts must be 0 or more, got {cfg.ddp_max_restarts}")
    bucket = cfg.ddp_bucket_cap_mb
    number = isinstance(bucket, (int, float)) and not isinstance(bucket, bool)
    if bucket != "auto" and not (number and math.isfinite(bucket) and bucket > 0):
        raise ConfigError(
            f"ddp_bucket_cap_mb must be auto or a size in MB above 0, got {bucket!r}: "
            "set ddp_bucket_cap_mb=auto or ddp_bucket_cap_mb=25"
        )
    if not (isinstance(cfg.compile_optimizer, bool) or cfg.compile_optimizer == "auto"):
        raise ConfigError(
            f"compile_optimizer must be auto, true or false (unquoted), got {cfg.compile_optimizer!r}: "
            "set compile_optimizer=auto"
        )
    if cfg.target_acc is not None and not 0.0 < cfg.target_acc <= 1.0:
        raise ConfigError(
            f"target_acc is a fraction in (0, 1], got {cfg.target_acc}: set e.g. target_acc=0.94"
        )
    if not 0 <= cfg.seed <= MAX_SEED:
        raise ConfigError(
            f"seed must be in [0, {MAX_SEED}] (numpy's range), got {cfg.seed}: set seed=0 or another "
            "whole number in that range"
        )


def check_combinations(cfg: TrainConfig) -> None:
    """Settings that each may hold but not together."""
    if cfg.ddp and cfg.data_parallel:
        raise ConfigError(
            "ddp=true and data_parallel=true both spread the batch over the devices: "
            "set data_parallel=false (DDP, one process per device) or ddp=false"
        )
    if cfg.data.source is not DataSource.synthetic and not cfg.data.root:
        raise ConfigError(f"data={cfg.data.source.value} needs a folder: set data.root=/path/to/data")
    if cfg.data.loader is LoaderKind.gpu and cfg.num_workers not in (0, "auto"):
        raise ConfigError("data.loader=gpu uses no worker processes: set num_workers=0 (or auto)")
    if cfg.data.loader is LoaderKind.gpu and cfg.data.decode is DecodeMode.every_epoch:
        raise ConfigError(
            "data.loader=gpu holds the decoded images on the device: set data.decode=once (or auto)"
        )
    graph_modes = (CompileMode.reduce_overhead, CompileMode.max_autotune)
    if cfg.compile and cfg.compile_mode in graph_modes and not cfg.set_to_none:
        # The first backward hands the graph's own output buffers to .grad; zeroing them in
        # place keeps them, and the next replay overwrites them mid-step (a RuntimeError).
        raise ConfigError(
            f"compile_mode={cfg.compile_mode.name} replays CUDA graphs, whose gradient buffers "
            "must be dropped between steps, not zeroed: set set_to_none=true, or "
            "compile_mode=max_autotune_no_cudagraphs"
        )
    if cfg.optim.early_epochs and cfg.optim.schedule not in (Schedule.linear, Schedule.constant):
        raise ConfigError(
            f"optim.early_epochs={cfg.optim.early_epochs} gives the early parameters a schedule of "
            f"their own beside optim.schedule's, which {cfg.optim.schedule.value} cannot: set "
            "optim.schedule=linear (or constant), or optim.early_epochs=0"
        )
    if cfg.optim.early_epochs > cfg.epochs:
        raise ConfigError(
            f"optim.early_epochs={cfg.optim.early_epochs} is more than epochs={cfg.epochs}: set "
            f"optim.early_epochs={cfg.epochs} or less (0: the early parameters train all run)"
        )
    if cfg.data.source is DataSource.synthetic and min(cfg.data.train_size, cfg.data.test_size) < 1:
        raise ConfigError("data.train_size and data.test_size must be at least 1")
