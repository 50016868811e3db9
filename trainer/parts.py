"""`Parts`: what one process trains with, as trainer/assembly.py hands it to the loop, the run and
the epoch report. Every field is decided; none is a setting still to be read.

Owns: the fields and what each holds. Must not touch: how they are built (trainer/assembly.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from trainer import evaluation, mfu, perf
from trainer.distributed import Ranks
from trainer.ema import NoAverage, WeightAverage

Batch = tuple[torch.Tensor, torch.Tensor]
ContextFactory = Callable[[], contextlib.AbstractContextManager]


@dataclass
class Parts:
    """What one process trains with. The loop reads these and nothing else: no field is a setting
    still to be decided."""

    device: torch.device
    ranks: Ranks
    setup_data_s: float  # of the set-up, the data's part: read, decoded or from its cache, on the device
    init_s: float  # of the set-up, the model's initialization from the data (a part of training)
    # data: the loaders yield uint8 batches; the *_batches are them on the device, normalized
    train_loader: object  # EpochLoader, GpuLoader or LowResEpochs: set_epoch(epoch, skip_batches) first
    train_batches: Iterable[Batch]
    test_batches: Iterable[Batch]
    classes: list[str]
    batch_size: int  # images per micro-batch in this process
    images_per_micro_batch: int  # the same, over every process
    batches_per_epoch: int  # micro-batches of a whole epoch (a resumed one skips some)
    # model: raw_model holds the weights; model is what the step calls, (images, labels) -> (loss,
    # correct), with the loss inside (channels_last, DDP or DataParallel, compile)
    raw_model: nn.Module
    model: nn.Module
    ddp_model: nn.parallel.DistributedDataParallel | None
    no_sync: ContextFactory  # around the micro-batches whose gradients are not all-reduced yet
    # after the backward that ends an optimizer step (ddp_sync=after_backward)
    average_gradients: Callable[[], None]
    # forward, backward and average_gradients of the micro-batch that ends an optimizer step as
    # one CUDA graph replay (step_graph=true), or None: the loop runs them one by one
    step_graph: perf.StepGraph | None
    sync_buffers: Callable[[], None]  # at each epoch's end: the same BatchNorm statistics on every rank
    average: WeightAverage | NoAverage  # what is evaluated, checkpointed and exported
    # the step
    autocast: ContextFactory
    scaler: torch.amp.GradScaler
    optimizer: torch.optim.Optimizer
    zero_grad: Callable[[], None]
    scheduler: torch.optim.lr_scheduler.LRScheduler
    lr_peak: float  # optim.lr scaled to the global batch
    # length and cadence
    epochs: int
    total_steps: int  # optimizer steps of the whole run, max_steps included
    grad_accum_steps: int
    log_every: int  # optimizer steps between reads of the loss (one host sync each)
    # evaluation plan
    eval_plan: evaluation.Plan
    tta_views: list[evaluation.View]
    tta_unsure: float  # the share of each test batch the views are for (eval.tta_unsure)
    evaluation_backend: ContextFactory  # cuDNN's heuristics, where the training autotunes
    target_acc: float | None
    # measuring and diagnosing
    warm_up_steps: int  # trained and undone before the clock starts (compile, cuDNN autotuning)
    cache_keys_ready: Callable[[], None]  # waits for torch's compile-cache keys, before the first compile
    autotuned: Callable[[], None]  # waits for cuDNN's autotuning begun ahead, before CUDA graphs record
    warm_up_work: str  # what those steps are for, for the run's log
    low_res_epochs: int  # the first epochs train on smaller images: a second shape to warm up
    mfu: mfu.Meter
    timer: object  # trainer.timing's data-wait timer: wrap(batches), step_done(), wait_seconds()
    synchronize: Callable[[], None]  # waits for the device (nothing on a CPU)
    non_finite_advice: str  # what to change when the loss stops being finite
    profile: bool  # trace a few steps with torch.profiler (the run writes the trace)
    tb_x_per_step: int  # TensorBoard's x advances this much per optimizer step (tb_step)
    description: str  # model and data in one line, for the run's log
