"""Hand-written training loops: the yardsticks that scripts/bench.py prints beside the trainer.

No config system, no logging, no checks. Two loaders, the two paths the trainer offers:

  --loader classic  the classic torchvision recipe: a PIL image per sample from the in-memory
                    uint8 array (as torchvision's CIFAR10 serves it), RandomCrop(32, padding=4),
                    RandomHorizontalFlip, ToTensor, Normalize, DataLoader(shuffle, drop_last,
                    persistent_workers), optional pinned memory, non-blocking copies, AMP with
                    a GradScaler for fp16, channels_last, cuDNN autotuning
  --loader gpu      perf=fast by hand: uint8 data on the GPU, per-image crop + flip there,
                    bf16 autocast, channels_last, CUDA-graph torch.compile, fused SGD,
                    zero_grad(set_to_none=True), no conv bias before BatchNorm; with
                    --low-res S --low-res-epochs N the first N epochs train on the augmented
                    batches downscaled to SxS (antialiased bilinear), as data.low_res does;
                    with --gpus N, data-parallel as the PyTorch documentation writes it: one
                    process per GPU (torch.multiprocessing.spawn), NCCL, each rank its share of
                    one shuffled order, torch.compile(DistributedDataParallel(model)) with
                    gradients as bucket views, --batch-size images per GPU; with
                    --optimizer muon the convolution weights take a hand-written Muon step,
                    compiled (scripts/handwritten_muon.py), the other parameters fused SGD

Both: ResNet-18 (CIFAR stem) or the cnn, SGD (lr 0.05, momentum 0.9, Nesterov, weight decay
5e-4) with OneCycle (20% warm-up), no label smoothing, a random flip each epoch, no TTA:
scripts/bench.py runs the trainer's rows with this recipe (PEER_RECIPE).

    python scripts/handwritten_loop.py --loader classic --workers 2 --epochs 3 --out /tmp/hand
    python scripts/handwritten_loop.py --loader classic --loader-only --workers 2   # CPU: no model
    python scripts/handwritten_loop.py --gpus 2 --batch-size 256 --epochs 3 --out /tmp/hand-ddp
    python scripts/handwritten_loop.py --optimizer muon --epochs 3 --out /tmp/hand-muon
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import torchvision.transforms as T
from handwritten_muon import HandMuon, split_parameters  # this script's folder
from PIL import Image
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from trainer.config import DataConfig, DataSource, ModelConfig, ModelName
from trainer.data import CIFAR10_MEAN, CIFAR10_STD, load_source, synthetic_split
from trainer.distributed import free_port
from trainer.models import build_model


class ClassicCifar(Dataset):
    """HWC uint8 images served as PIL images through a transform, as torchvision's CIFAR10."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, transform):
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.transform(Image.fromarray(self.images[index])), int(self.labels[index])


def training_images(data_root: str | None, train_size: int = 50_000) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, 3, 32, 32) uint8 images and labels: class folders under data_root/train (read with
    the trainer's decoder and its cache, outside the timed loop), or the synthetic set."""
    if data_root is None:
        split = synthetic_split(train_size, train=True, seed=0)
    else:
        cfg = DataConfig(source=DataSource.imagefolder, root=data_root, decode_cache=True)
        split = load_source(cfg, seed=0, processes=len(os.sched_getaffinity(0))).train
    return split.images, split.labels


def classic_loader(images: torch.Tensor, labels: torch.Tensor, args) -> DataLoader:
    transform = T.Compose(
        [
            T.RandomCrop(32, padding=4),
            T.RandomHorizontalFlip(),
            T.ToTensor(),
            T.Normalize(CIFAR10_MEAN, CIFAR10_STD),
        ]
    )
    dataset = ClassicCifar(images.permute(0, 2, 3, 1).numpy(), labels.numpy(), transform)
    return DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=args.workers,
        pin_memory=args.pin_memory,
        persistent_workers=args.workers > 0,
    )


def gpu_batches(
    images: torch.Tensor,
    labels: torch.Tensor,
    batch_size: int,
    device: torch.device,
    epoch: int,
    rank=0,
    world=1,
):
    """One epoch of augmented, normalized batches from uint8 images already on the device: this
    rank's share of one order that every rank draws alike (seeded by the epoch)."""
    arange = torch.arange(32, device=device)
    channels = torch.arange(3, device=device)[None, :, None, None]
    mean = torch.tensor(CIFAR10_MEAN, device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor(CIFAR10_STD, device=device).view(1, 3, 1, 1) * 255
    shuffled = torch.randperm(len(labels), generator=torch.Generator().manual_seed(epoch))
    order = shuffled[rank::world].to(device)
    for step in range(len(labels) // world // batch_size):
        index = order[step * batch_size : (step + 1) * batch_size]
        top = torch.randint(0, 9, (len(index), 1), device=device)
        left = torch.randint(0, 9, (len(index), 1), device=device)
        flip = torch.rand(len(index), 1, device=device) < 0.5
        rows = (top + arange)[:, None, :, None]
        cols = (left + torch.where(flip, arange.flip(0), arange))[:, None, None, :]
        batch = images[index[:, None, None, None], channels, rows, cols]
        yield ((batch.float() - mean) / std).contiguous(memory_format=torch.channels_last), labels[index]


def arguments():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--loader", default="gpu", choices=["gpu", "classic"])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=None, help="default: 512 (gpu), 128 (classic)")
    parser.add_argument("--data-root", default=None, help="class folders (train/, test/); default synthetic")
    parser.add_argument("--train-size", type=int, default=50_000, help="synthetic images")
    parser.add_argument("--out", type=Path, default=None, help="folder for metrics.json")
    classic = parser.add_argument_group("classic loader")
    classic.add_argument("--workers", type=int, default=2)
    classic.add_argument("--pin-memory", action="store_true", help="also non-blocking copies")
    classic.add_argument("--amp", default="none", choices=["none", "bf16", "fp16"])
    classic.add_argument("--channels-last", action="store_true")
    classic.add_argument("--set-to-none", action="store_true")
    classic.add_argument("--cudnn-benchmark", action="store_true")
    classic.add_argument("--loader-only", action="store_true", help="iterate the loader, no model")
    parser.add_argument("--compile-mode", default="reduce-overhead", help="gpu loader; none: eager")
    parser.add_argument("--low-res", type=int, default=0, help="gpu loader: the first epochs' image size")
    parser.add_argument(
        "--low-res-epochs", type=int, default=0, help="gpu loader: how many epochs at --low-res"
    )
    parser.add_argument("--gpus", type=int, default=1, help="gpu loader: data-parallel over this many GPUs")
    muon = parser.add_argument_group("gpu loader, --optimizer muon (scripts/handwritten_muon.py)")
    muon.add_argument("--optimizer", default="sgd", choices=["sgd", "muon"])
    muon.add_argument("--muon-lr", type=float, default=0.12)
    muon.add_argument("--muon-momentum", type=float, default=0.6)
    muon.add_argument("--muon-ns-steps", type=int, default=3)
    args = parser.parse_args()
    if args.gpus > 1 and args.loader != "gpu":
        parser.error("--gpus: the gpu loader only")
    if args.optimizer == "muon" and args.loader != "gpu":
        parser.error("--optimizer muon: the gpu loader only")
    available = torch.cuda.device_count() if torch.cuda.is_available() else None
    if args.gpus < 1 or (available is not None and args.gpus > available):
        parser.error(
            f"--gpus {args.gpus}: this host has {available or 'no'} CUDA GPUs (without any: CPU ranks)"
        )
    args.batch_size = args.batch_size or (512 if args.loader == "gpu" else 128)
    return args


def main() -> None:
    args = arguments()
    if args.gpus == 1:
        train(0, args, None)
        return
    mp.spawn(train, args=(args, free_port()), nprocs=args.gpus)  # the port of the ranks' rendezvous


def train(rank: int, args, port: int | None) -> None:
    world, gpu_path = args.gpus, args.loader == "gpu"
    device = torch.device(f"cuda:{rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    images, labels = training_images(args.data_root, args.train_size)
    steps_per_epoch = len(labels) // world // args.batch_size
    if gpu_path:
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        images, labels = F.pad(images.to(device), (4, 4, 4, 4)), labels.to(device)
        amp_dtype, channels_last, set_to_none, non_blocking = torch.bfloat16, True, True, False
    else:
        torch.backends.cudnn.benchmark = args.cudnn_benchmark
        loader = classic_loader(images, labels, args)
        amp_dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]
        channels_last, set_to_none, non_blocking = args.channels_last, args.set_to_none, args.pin_memory

    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = build_model(ModelConfig(name=ModelName(args.model), conv_bias=not gpu_path), 10)
    model = model.to(device, memory_format=fmt)
    step_model = model
    if world > 1:  # one bucket per ~25 MB of gradient, all-reduced while backward goes on
        step_model = DistributedDataParallel(model, gradient_as_bucket_view=True)
    if gpu_path and args.compile_mode != "none":
        # static shapes: a second image size (--low-res) gets a graph of its own, not a dynamic one
        step_model = torch.compile(step_model, mode=args.compile_mode, dynamic=False)
    peak_lr = 0.05 * args.batch_size * world / 128  # 0.05 per 128 images, scaled linearly
    muon_weights, sgd_params = [], list(model.parameters())
    if args.optimizer == "muon":
        muon_weights, sgd_params = split_parameters(model)
    optimizer = torch.optim.SGD(
        sgd_params, lr=peak_lr, momentum=0.9, nesterov=True, weight_decay=5e-4, fused=gpu_path or None
    )
    muon = None
    if muon_weights:
        mode = "none" if device.type != "cuda" else args.compile_mode
        muon = HandMuon(muon_weights, args.muon_lr, args.muon_momentum, args.muon_ns_steps, mode)
    graphed = args.compile_mode in ("reduce-overhead", "max-autotune")  # replayed as CUDA graphs
    graph_steps = muon is not None and device.type == "cuda" and graphed
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, peak_lr, total_steps=args.epochs * steps_per_epoch, pct_start=0.2
    )
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)

    def autocast():
        if amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=amp_dtype)

    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    history = []
    for epoch in range(args.epochs):
        synchronize()
        started = time.perf_counter()
        if gpu_path:
            batches = gpu_batches(images, labels, args.batch_size, device, epoch, rank, world)
        else:
            batches = loader
        low_res = gpu_path and epoch < args.low_res_epochs and args.low_res
        for batch, target in batches:
            if args.loader_only:
                continue
            if graph_steps:
                # two compiled CUDA-graph functions (the model's, Muon's step): each step is told
                # where it begins, as torch's error asks, or Muon's replay can overwrite tensors
                # the model's graphs still hold
                torch.compiler.cudagraph_mark_step_begin()
            batch = batch.to(device, non_blocking=non_blocking, memory_format=fmt)
            if low_res:
                size = (args.low_res, args.low_res)
                batch = F.interpolate(batch, size=size, mode="bilinear", antialias=True, align_corners=False)
                batch = batch.contiguous(memory_format=fmt)
            target = target.to(device, non_blocking=non_blocking)
            with autocast():
                loss = F.cross_entropy(step_model(batch), target)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=set_to_none)
            if muon is not None:  # bf16: no scaler between it and the gradients
                muon.step()
                muon.zero_grad()
            scheduler.step()
        synchronize()
        seconds = torch.tensor(time.perf_counter() - started, device=device)
        if world > 1:  # the epoch lasts as long as its slowest rank
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        history.append(
            {
                "epoch": epoch + 1,
                "epoch_s": seconds.item(),
                "img_per_s": steps_per_epoch * args.batch_size * world / seconds.item(),
                "data_wait_frac": None,
            }
        )
        if rank == 0:
            print(f"epoch {epoch + 1}: {history[-1]['img_per_s']:,.0f} img/s", flush=True)

    if args.out and rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
        metrics = {"status": "completed", "history": history, "test_acc": None, "peak_mem_mb": peak}
        (args.out / "metrics.json").write_text(json.dumps({**metrics, "world_size": world}, indent=2))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
