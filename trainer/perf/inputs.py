"""The input pipeline's toggles: DataLoader workers, pinned memory, host-to-device copies in
the model's memory format, and prefetching on a side stream.

Must not touch: what the loaders hold or how they augment (trainer/data/), the model and the
step (the other files of trainer/perf/).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator

import torch

from trainer.config import TrainConfig
from trainer.data import Normalizer
from trainer.perf.model import memory_format
from trainer.perf.notes import cannot_act, cuda_only

log = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]


def leave_stops_to_the_main_process(_worker_id: int) -> None:
    """In each DataLoader worker. Ctrl-C and `kill -TERM -- -<pgid>` (terminals, job schedulers)
    reach every process of the group, and a worker that dies of them fails the run. A worker
    leaves for a process group of its own, so only the main process gets them: it stops at the
    next step, saves, and ends its workers itself (a SIGTERM sent to a worker still ends it)."""
    os.setpgid(0, 0)


def worker_count(cfg: TrainConfig, device: torch.device, processes_per_host: int, in_memory: bool) -> int:
    """num_workers, with auto resolved. 0 where the images are in memory: a whole batch is a few
    numpy slices, and handing it from a worker process costs more than building it (ResNet-18 at
    512 per GPU on H200s: 83k img/s with 0 workers against 70k with 4, and 91.8% per GPU on two
    against 81.2%), and on a CPU device, whose training step already uses every core. Images
    decoded file by file (data.decode=every_epoch): 4 per GPU (enough to feed one at CIFAR
    sizes), capped by the cores each training process has less one for itself."""
    if cfg.num_workers != "auto":
        return cfg.num_workers
    if device.type != "cuda" or in_memory:
        return 0
    cores_per_process = len(os.sched_getaffinity(0)) // max(processes_per_host, 1)
    return max(0, min(4, cores_per_process - 1))


def worker_start() -> multiprocessing.context.BaseContext | None:
    """How DataLoader workers start: forked where the platform can fork, else its default.

    A DDP rank is itself a spawned process, and a spawned process starts its own children the
    same way, so without this each worker of a rank was spawned and sent the whole dataset
    through a pipe (on 2 H200s `ddp=true perf=fast data.loader=torch` sat in worker start-up for
    minutes). Forked workers share the parent's arrays copy-on-write, as they do in one process.
    They only slice and decode on the CPU; CUDA stays in the parent."""
    if "fork" in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("fork")
    return None


def dataloader_kwargs(
    cfg: TrainConfig, device: torch.device, processes_per_host: int = 1, in_memory: bool = True
) -> dict:
    """in_memory: the images are held decoded (not decoded file by file as batches are built)."""
    pin = cuda_only(
        cfg, "pin_memory", device, f"page-locked memory speeds copies to CUDA, device is {device}"
    )
    workers = worker_count(cfg, device, processes_per_host, in_memory)
    if cfg.num_workers == "auto":
        level = logging.INFO if device.type == "cuda" else logging.DEBUG
        log.log(level, "num_workers=auto: %d worker processes", workers)
    kwargs = {"num_workers": workers, "pin_memory": pin}
    if workers > 0:
        kwargs["persistent_workers"] = cfg.persistent_workers
        kwargs["prefetch_factor"] = cfg.prefetch_factor
        kwargs["worker_init_fn"] = leave_stops_to_the_main_process
        kwargs["multiprocessing_context"] = worker_start()
    elif cfg.persistent_workers or cfg.prefetch_factor is not None:
        cannot_act("persistent_workers / prefetch_factor", "num_workers=auto picked no workers")
    return kwargs


def batch_mover(cfg: TrainConfig, device: torch.device) -> Callable[[Batch], Batch]:
    """Host-to-device copy of a uint8 batch in the model's memory format, then conversion to
    normalized float there."""
    non_blocking = cuda_only(cfg, "non_blocking", device, f"copies to {device} are synchronous")
    fmt = memory_format(cfg)
    normalize = Normalizer(device)

    def move(batch: Batch) -> Batch:
        images, labels = batch
        return (
            normalize(images.to(device, non_blocking=non_blocking, memory_format=fmt)),
            labels.to(device, non_blocking=non_blocking),
        )

    return move


class CudaPrefetcher:
    """Copies the next batch on a side stream while the current one computes."""

    def __init__(self, loader: Iterable[Batch], move: Callable[[Batch], Batch], device: torch.device):
        self.loader, self.move = loader, move
        self.stream = torch.cuda.Stream(device)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Batch]:
        batches = iter(self.loader)
        compute = torch.cuda.current_stream()

        def load_next() -> Batch | None:
            batch = next(batches, None)
            if batch is None:
                return None
            if batch[0].is_cuda:  # made on the compute stream (data.loader=gpu): read it once written
                self.stream.wait_stream(compute)
            with torch.cuda.stream(self.stream):
                return self.move(batch)

        upcoming = load_next()
        while upcoming is not None:
            compute.wait_stream(self.stream)
            for tensor in upcoming:
                tensor.record_stream(compute)
            current, upcoming = upcoming, load_next()
            yield current


class Moved:
    """The loader's batches, each moved to the device as it is drawn."""

    def __init__(self, loader: Iterable[Batch], move: Callable[[Batch], Batch]):
        self.loader, self.move = loader, move

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Batch]:
        return map(self.move, self.loader)


def device_batches(cfg: TrainConfig, loader: Iterable[Batch], device: torch.device) -> Iterable[Batch]:
    """The loader as an iterable of device-ready batches (prefetched when asked and possible)."""
    move = batch_mover(cfg, device)
    if cfg.data.prefetch:
        if device.type == "cuda":
            return CudaPrefetcher(loader, move, device)
        cannot_act("data.prefetch=true", f"the side-stream copy needs CUDA, device is {device}")
    return Moved(loader, move)
