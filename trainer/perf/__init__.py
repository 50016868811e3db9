"""Every optimization toggle is read and applied in this package, once, at build time.

Order for the model: activation checkpointing (in models.build_model) -> channels_last
-> DDP wrap (with its communication toggles) or DataParallel -> torch.compile. Where a
toggle cannot act on this device, one log line says so and the run carries on with it off.

A new toggle is a field in trainer/config.py and a few lines in the file of its concern:
  __init__.py  the step's own: precision (amp, its dtype, the gradient scaler), zero_grad,
               the optimizer's fused kernels
  cpu_bf16.py  whether bf16 autocast pays on this CPU (timed once, for amp's warning)
  backend.py   torch.backends switches (deterministic, cudnn_benchmark, tf32), the warm-up
               steps their autotuning (or torch.compile) calls for, the evaluation's switches
  inputs.py    DataLoader workers, pinned memory, non-blocking copies, prefetching
  model.py     channels_last, DataParallel, torch.compile: the model the step calls
  compile_workers.py  when torch.compile's compile-worker pool is stopped, and how
  compile_keys.py  torch's compile-cache keys worked out beside the set-up
  cuda_start.py  CUDA, cuDNN and cuBLAS started in a thread beside the set-up's imports
  autotune_ahead.py  cuDNN's autotuning of the convolutions on a copy, begun beside the data's set-up
  ddp.py       how ranks average gradients (ddp_sync): DistributedDataParallel and its ddp_*
               communication toggles, or all_reduce.py's one all-reduce after backward
  step_graph.py forward, backward and gradient average as one CUDA graph (step_graph)
  profiler.py  torch.profiler over a few steps
  notes.py     the one log line of a toggle that cannot act here
trainer/assembly.py calls these and hands their results to the loop, which never reads a toggle.
Must not touch: the run folder, the order of the loop, process groups.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from typing import TypeVar

import torch

from trainer.config import AmpDtype, TrainConfig
from trainer.data import IMAGE_SIZE
from trainer.perf import autotune_ahead
from trainer.perf.all_reduce import BufferAverage, GradientAverage, broadcast_module
from trainer.perf.backend import (
    WARM_UP_STEPS,
    apply_backend_flags,
    evaluation_backend,
    warm_up_steps,
    warm_up_work,
)
from trainer.perf.compile_keys import cache_keys_ahead
from trainer.perf.compile_workers import stop_compile_workers
from trainer.perf.cpu_bf16 import cpu_bf16_slowdown
from trainer.perf.cuda_start import cuda_ahead, make_current
from trainer.perf.ddp import (
    DDP_TOGGLES,
    DDP_WRAPPER_TOGGLES,
    bucket_cap_mb,
    comm_hook,
    distributed_data_parallel,
    gradient_sync,
    muon_share,
    unused_ddp_toggles,
)
from trainer.perf.inputs import (
    CudaPrefetcher,
    Moved,
    batch_mover,
    dataloader_kwargs,
    device_batches,
    leave_stops_to_the_main_process,
    worker_count,
)
from trainer.perf.model import (
    data_parallel,
    memory_format,
    optimizer_compiler,
    prepare_model,
    splits_over_gpus,
)
from trainer.perf.notes import at_default, cannot_act, override_value, say_once
from trainer.perf.profiler import Profiler
from trainer.perf.step_graph import StepGraph, step_graph_acts

T = TypeVar("T")

__all__ = [
    "DDP_TOGGLES",
    "DDP_WRAPPER_TOGGLES",
    "WARM_UP_STEPS",
    "BufferAverage",
    "CudaPrefetcher",
    "Moved",
    "Profiler",
    "amp_dtype",
    "apply_backend_flags",
    "at_default",
    "autotune_ahead",
    "autocast_context",
    "begin_ahead",
    "beside_autotuning",
    "cache_keys_ahead",
    "cuda_ahead",
    "make_current",
    "evaluation_backend",
    "broadcast_module",
    "batch_mover",
    "bucket_cap_mb",
    "cannot_act",
    "comm_hook",
    "cpu_bf16_slowdown",
    "data_parallel",
    "dataloader_kwargs",
    "device_batches",
    "distributed_data_parallel",
    "GradientAverage",
    "gradient_sync",
    "muon_share",
    "grad_scaler",
    "leave_stops_to_the_main_process",
    "memory_format",
    "non_finite_advice",
    "optimizer_compiler",
    "stop_compile_workers",
    "optimizer_kwargs",
    "override_value",
    "prepare_model",
    "say_once",
    "splits_over_gpus",
    "step_graph_acts",
    "StepGraph",
    "unused_ddp_toggles",
    "warm_up_steps",
    "warm_up_work",
    "worker_count",
    "zero_grad",
]


def amp_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for full precision."""
    if not cfg.amp:
        return None
    slowdown = cpu_bf16_slowdown() if device.type == "cpu" else None
    if slowdown:
        say_once(
            logging.WARNING,
            "amp=true on this CPU will be slower than fp32: a bf16 convolution step ran %.1fx slower "
            "than fp32 here (timed at start-up). Set amp=false here",
            slowdown,
        )
    if cfg.amp_dtype is AmpDtype.auto:
        cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if device.type == "cpu" or cuda_bf16 else torch.float16
    if cfg.amp_dtype is AmpDtype.fp16 and device.type == "cpu":
        cannot_act("amp_dtype=fp16", "fp16 autocast on CPU is ~100x slower; using bf16")
        return torch.bfloat16
    return torch.bfloat16 if cfg.amp_dtype is AmpDtype.bf16 else torch.float16


def begin_ahead(cfg: TrainConfig, device: torch.device) -> tuple[Callable[[], None], Callable[[], None]]:
    """The work begun in threads beside the set-up, each with what waits for it: CUDA's start in
    the run's precision (cuda_start.py; the assembly's end waits) and torch's compile-cache keys
    (compile_keys.py; the warm-up waits, before its first compile)."""
    return cuda_ahead(cfg, device, lambda: amp_dtype(cfg, device)), cache_keys_ahead(cfg)


def beside_autotuning(
    cfg: TrainConfig, device: torch.device, work: Callable[[], T], build: Callable[[int], torch.nn.Module]
) -> T:
    """`work()` (the data's set-up) in a thread while this thread times cuDNN's forward
    convolutions on a copy of the model (`build(classes)`) at each of the run's batch shapes, in
    its precision and memory format, then their backward in a thread (autotune_ahead.py); the
    warm-up waits for that before CUDA graphs record (`autotune_ahead.wait`). Returns `work()`'s
    result; where cuDNN does not autotune, `work()` alone."""
    low_res = (cfg.data.low_res, cfg.data.low_res_epochs)
    shapes = autotune_ahead.shapes_to_time(cfg.batch_size, IMAGE_SIZE, *low_res)
    settings = (repr(cfg.model), *shapes, cfg.amp, cfg.amp_dtype, cfg.channels_last, cfg.tf32, str(device))
    dtype = functools.partial(amp_dtype, cfg, device)
    return autotune_ahead.beside(work, build, device, shapes, dtype, memory_format(cfg), settings)


def autocast_context(
    cfg: TrainConfig, device: torch.device
) -> Callable[[], contextlib.AbstractContextManager]:
    dtype = amp_dtype(cfg, device)
    if dtype is None:
        return contextlib.nullcontext
    return functools.partial(torch.autocast, device_type=device.type, dtype=dtype)


def non_finite_advice(cfg: TrainConfig, device: torch.device, lr_peak: float) -> str:
    """What to change when the loss runs away or the run does not learn: a lower learning rate,
    then the precision."""
    advice = f"lower optim.lr (now {cfg.optim.lr}, a peak of {lr_peak:.4g} at this batch)"
    dtype = amp_dtype(cfg, device)
    if dtype is None:
        return advice
    if dtype == torch.float16:
        return f"{advice}, or use amp_dtype=bf16 / amp=false"
    return f"{advice}, or set amp=false"


def grad_scaler(cfg: TrainConfig, device: torch.device) -> torch.amp.GradScaler:
    """Loss scaling only for fp16 on CUDA; a disabled scaler passes everything through."""
    enabled = amp_dtype(cfg, device) == torch.float16 and device.type == "cuda"
    return torch.amp.GradScaler(device.type, enabled=enabled)


def zero_grad(cfg: TrainConfig, optimizer: torch.optim.Optimizer, captured: bool) -> Callable[[], None]:
    """After each optimizer step; nothing under step_graph, whose backward writes every gradient
    anew into memory its graph owns (zeroing them is wasted work, dropping them loses them)."""
    if captured:
        return lambda: None
    return functools.partial(optimizer.zero_grad, set_to_none=cfg.set_to_none)


def optimizer_kwargs(cfg: TrainConfig) -> dict:
    """torch has fused SGD and AdamW kernels for CUDA and CPU."""
    return {"fused": True} if cfg.fused_optimizer else {}
