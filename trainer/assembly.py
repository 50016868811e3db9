"""The assembly: a config in, the `Parts` one process trains with out; every decision taken once.

    parts = assemble(cfg, ranks, resolve_device(cfg.device, ranks, cfg.ddp))

Owns: what a run is made of. The seeds; the data (source, loader kind, the batches as the
device gets them); the model as the step calls it; the optimizer at the peak lr scaled to the
global batch, its schedule, the gradient scaler and the weight average; the autocast context;
the step budget (epochs, max_steps, accumulation) and the evaluation plan. A new component
is a field of `Parts` (trainer/parts.py) and a line in one of the builders below.
Must not touch: the optimization toggles themselves (read and applied in trainer/perf/, whose
results this file hands on), the run folder, checkpoints and signals (trainer/run.py), the
order of work in an epoch or a step (trainer/loop.py), process groups (trainer/distributed.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import time

import torch
from torch import nn

from trainer import checkpoint, evaluation, mfu, perf
from trainer.config import ConfigError, DdpSync, FlipMode, LoaderKind, TbStep, TrainConfig
from trainer.data import IMAGE_SIZE, Splits, begin_listing, gpu_loaders, load_source, torch_loaders
from trainer.data.augment import CropFlip
from trainer.data.resolution import LowResEpochs
from trainer.data.sources import ListingAhead
from trainer.distributed import Ranks
from trainer.ema import weight_average
from trainer.models import build_model, check_low_res, initialize_from_data, shapes_only
from trainer.optim import build_optimizer, build_scheduler, logged_peak_lr
from trainer.parts import Parts
from trainer.preflight import no_cuda_device
from trainer.timing import data_wait_timer

log = logging.getLogger(__name__)


def nothing() -> None:
    """What a process alone does to average gradients or statistics over the ranks."""


def resolve_device(spec: str, ranks: Ranks, ddp: bool) -> torch.device:
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(no_cuda_device(spec))
    if spec.startswith("cuda") and ddp:
        return torch.device("cuda", ranks.local_rank)
    return torch.device(spec)


def assemble(cfg: TrainConfig, ranks: Ranks, device: torch.device) -> Parts:
    """Seeds and backend flags, then data, model and step (weights drawn after the seeds)."""
    checkpoint.seed_rngs(cfg.seed)
    perf.apply_backend_flags(cfg, device)
    listing = begin_listing(cfg.data)  # the helper process first: it runs beside what follows
    cuda_ready, cache_keys_ready = perf.begin_ahead(cfg, device)  # beside the data's set-up
    splits, train_loader, train_batches, test_batches, setup_data_s = data_beside_autotuning(
        cfg, ranks, device, listing
    )
    raw_model, model, ddp_model, step_graph, meter, init_s = build_network(cfg, ranks, device, splits)
    global_batch = cfg.batch_size * ranks.world_size * cfg.grad_accum_steps
    optimizer, lr_peak = step_optimizer(cfg, ranks, device, raw_model, global_batch)
    average, average_gradients, sync_buffers = averages(cfg, ranks, raw_model, ddp_model)
    steps_per_epoch, total_steps = step_budget(cfg, len(train_loader))
    cuda_ready()
    return Parts(
        setup_data_s=setup_data_s,
        init_s=init_s,
        device=device,
        ranks=ranks,
        train_loader=train_loader,
        train_batches=train_batches,
        test_batches=test_batches,
        classes=splits.classes,
        batch_size=cfg.batch_size,
        images_per_micro_batch=cfg.batch_size * ranks.world_size,
        batches_per_epoch=len(train_loader),
        raw_model=raw_model,
        model=model,
        ddp_model=ddp_model,
        no_sync=ddp_model.no_sync if ddp_model is not None else contextlib.nullcontext,
        step_graph=step_graph,
        average_gradients=average_gradients,
        sync_buffers=sync_buffers,
        average=average,
        autocast=perf.autocast_context(cfg, device),  # says once where amp cannot act as asked
        scaler=perf.grad_scaler(cfg, device),
        optimizer=optimizer,
        zero_grad=perf.zero_grad(cfg, optimizer, captured=step_graph is not None),
        scheduler=build_scheduler(cfg.optim, optimizer, total_steps, steps_per_epoch),
        lr_peak=lr_peak,
        epochs=cfg.epochs,
        total_steps=total_steps,
        grad_accum_steps=cfg.grad_accum_steps,
        log_every=cfg.log_every,
        eval_plan=evaluation.Plan(cfg.eval.from_epoch, cfg.eval_every),
        tta_views=evaluation.tta_views(cfg.eval.tta),
        tta_unsure=cfg.eval.tta_unsure,
        evaluation_backend=perf.evaluation_backend(device),
        target_acc=cfg.target_acc,
        **warm_up_parts(cfg, device, step_graph is not None, cache_keys_ready),
        mfu=meter,
        timer=data_wait_timer(cfg.measure_data_wait, device.type),
        synchronize=torch.cuda.synchronize if device.type == "cuda" else (lambda: None),
        non_finite_advice=perf.non_finite_advice(cfg, device, lr_peak),
        profile=cfg.profile and ranks.is_main,
        tb_x_per_step=global_batch if cfg.tb_step is TbStep.images else 1,
        description=describe(cfg, splits),
    )


def warm_up_parts(cfg: TrainConfig, device: torch.device, captured: bool, cache_keys_ready) -> dict:
    """What the warm-up before the clock needs: its steps, what they are for, each image size to
    warm up, and the waits for the work begun ahead (compile-cache keys, cuDNN's autotuning)."""
    return {
        "cache_keys_ready": cache_keys_ready,
        "autotuned": perf.autotune_ahead.wait,
        "warm_up_steps": perf.warm_up_steps(cfg, device, captured=captured),
        "warm_up_work": perf.warm_up_work(cfg, device, captured=captured),
        "low_res_epochs": cfg.data.low_res_epochs,
    }


def describe(cfg: TrainConfig, splits: Splits) -> str:
    """Model and data in one line, for the run's log (which names the device before it)."""
    return (
        f"model: {cfg.model.target or cfg.model.name.value} | "
        f"data: {cfg.data.source.value} ({len(splits.train)} train, {len(splits.test)} test)"
    )


def data_beside_autotuning(
    cfg: TrainConfig, ranks: Ranks, device: torch.device, listing: ListingAhead | None
) -> tuple:
    """build_data's result, the data built in a thread while cuDNN times the forward
    convolutions of a copy of the model on this one (trainer/perf/autotune_ahead.py), where it
    autotunes; built here otherwise."""
    data = functools.partial(build_data, cfg, ranks, device, listing)
    return perf.beside_autotuning(cfg, device, data, functools.partial(build_model, shapes_only(cfg.model)))


def build_data(
    cfg: TrainConfig, ranks: Ranks, device: torch.device, listing: ListingAhead | None = None
) -> tuple:
    """(splits, train loader, train batches, test batches, seconds): the images decoded or read
    once (the files as `listing` found them, where begun), this rank's loaders over them, their
    batches as the device takes them, and the seconds all this took (metrics.json's setup_data_s)."""
    started = time.perf_counter()
    processes_per_host = int(os.environ.get("LOCAL_WORLD_SIZE", ranks.world_size))
    decoders = max(1, len(os.sched_getaffinity(0)) // processes_per_host)
    splits = load_source(cfg.data, cfg.seed, processes=decoders, listing=listing)
    common = dict(
        augment=cfg.data.augment,
        batch_size=cfg.batch_size,
        seed=cfg.seed,
        rank=ranks.rank,
        world_size=ranks.world_size,
        cutout=cfg.data.cutout,
        crop_flip=CropFlip(
            cfg.data.crop_padding, cfg.data.flip is FlipMode.alternating, cfg.data.padding_mode.value
        ),
    )
    if cfg.data.loader is LoaderKind.gpu:
        if device.type != "cuda":
            perf.cannot_act("data.loader=gpu", f"device is {device}: the dataset stays in host memory")
        train, test = gpu_loaders(splits, device=device, epochs=cfg.epochs, **common)
    else:
        in_memory = splits.train.images is not None
        loader_kwargs = perf.dataloader_kwargs(cfg, device, processes_per_host, in_memory)
        train, test = torch_loaders(splits, loader_kwargs=loader_kwargs, **common)
    if len(train) == 0:
        raise ConfigError(
            f"batch_size={cfg.batch_size} x {ranks.world_size} process(es) is larger than the "
            f"{len(splits.train)} training images: lower batch_size"
        )
    train_batches = perf.device_batches(cfg, train, device)
    if cfg.data.low_res:
        train = train_batches = LowResEpochs(train, train_batches, cfg.data.low_res, cfg.data.low_res_epochs)
    test_batches = perf.device_batches(cfg, test, device)
    return splits, train, train_batches, test_batches, time.perf_counter() - started


def build_network(cfg: TrainConfig, ranks: Ranks, device: torch.device, splits: Splits) -> tuple:
    """(raw model, the model the step calls, the DDP wrapper or None, the step's CUDA graph or
    None, the MFU meter, the seconds the model's initialization from the data took)."""
    if cfg.data.low_res:
        check_low_res(cfg.model, len(splits.classes), cfg.data.low_res)
    raw_model = build_model(cfg.model, num_classes=len(splits.classes))
    init_s = initialize_from_data(raw_model, splits.train, device)
    wrapped = []

    def wrap_ddp(module: nn.Module) -> nn.Module:
        wrapped.append(perf.distributed_data_parallel(cfg, module, device))
        return wrapped[0]

    sync = perf.gradient_sync(cfg, raw_model) if ranks.world_size > 1 else None
    wrapper = wrap_ddp if sync is DdpSync.wrapper else None
    loss_fn = nn.CrossEntropyLoss(label_smoothing=cfg.optim.label_smoothing)
    captured = perf.step_graph_acts(cfg, device, sync, perf.splits_over_gpus(cfg, device))
    model = perf.prepare_model(cfg, raw_model, loss_fn, device, wrapper, ranks.world_size, captured)
    if sync is DdpSync.after_backward:
        perf.broadcast_module(raw_model)  # rank 0's initial weights, as the wrapper would
    batch_shape = (cfg.batch_size, 3, IMAGE_SIZE, IMAGE_SIZE)
    meter = mfu.meter(cfg, device, len(splits.classes), batch_shape, ranks.world_size)
    step_graph = perf.StepGraph.of(raw_model) if captured else None
    return raw_model, model, wrapped[0] if wrapped else None, step_graph, meter, init_s


def step_optimizer(
    cfg: TrainConfig, ranks: Ranks, device: torch.device, raw_model: nn.Module, global_batch: int
) -> tuple[torch.optim.Optimizer, float]:
    """(the optimizer, its peak lr): optim.lr scaled to the global batch (said in the run's log),
    with what perf decides for the optimizer: fused kernels, the compile of Muon's arithmetic,
    each rank's share of it."""
    lr_peak = logged_peak_lr(cfg.optim, global_batch)
    compiler, share = perf.optimizer_compiler(cfg, device), perf.muon_share(cfg, ranks)
    optimizer = build_optimizer(cfg.optim, raw_model, perf.optimizer_kwargs(cfg), lr_peak, compiler, share)
    return optimizer, lr_peak


def averages(cfg: TrainConfig, ranks: Ranks, raw_model: nn.Module, ddp_model) -> tuple:
    """(the weight average (ema), average the gradients, average the BatchNorm statistics) over
    the ranks: the gradients by hand where no DistributedDataParallel does it
    (ddp_sync=after_backward), the statistics wherever there are ranks; nothing in one process."""
    average = weight_average(cfg.ema, raw_model)
    if ranks.world_size == 1:
        return average, nothing, nothing
    gradients = perf.GradientAverage(raw_model) if ddp_model is None else nothing
    return average, gradients, perf.BufferAverage([raw_model, average.module])


def step_budget(cfg: TrainConfig, batches_per_epoch: int) -> tuple[int, int]:
    """(optimizer steps per epoch, the run's optimizer steps: every epoch's, or max_steps where
    that comes first)."""
    steps_per_epoch = math.ceil(batches_per_epoch / cfg.grad_accum_steps)
    total_steps = cfg.epochs * steps_per_epoch
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)
    if cfg.ema.enabled and cfg.ema.update_every > total_steps:
        raise ConfigError(
            f"ema.update_every={cfg.ema.update_every} is more than this run's {total_steps} "
            "optimizer steps: the average would never be updated and would be the random "
            "initialization. Lower ema.update_every, or set ema.enabled=false"
        )
    return steps_per_epoch, total_steps
