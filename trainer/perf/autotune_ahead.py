"""cuDNN's autotuning of the backward convolutions begun in a thread, beside the set-up.

With cudnn_benchmark=true cuDNN times its algorithms at the first convolution of each shape,
forward and backward, and a fresh process pays it inside its warm-up, one convolution after
another, while the GPU has idled through the set-up. torch keeps what it timed per thread, and a
backward pass runs on autograd's thread for its device, whichever thread called it: so a copy of
the model, trained one step on zeros from a thread of ours, has the backward convolutions timed
on the very thread the run's backward passes run on, while the main thread builds the model,
imports torch.compile's compiler and traces. The forward's timing stays in our thread and is
done again by the run (torch offers no way to hand it over). On one H100 (torch 2.11.0+cu130,
batch 2000 of 32x32 in bf16, channels_last), the first compiled backward took 0.01 s after such
a step against 0.84 s without it for the fast CNN, and 0.008 s against 0.94 s for ResNet-18 at
batch 1024 (README, "From Enter to result").

Not where a CUDA graph is captured while the thread runs: a capture forbids other threads'
allocations and synchronizations (torch.cuda.graph's default mode). `wait()` comes first in each
capture of ours and in the warm-up before its second step, where torch.compile's CUDA graphs
record.

Owns: which shapes are timed ahead, on what, and when that is waited for. Must not touch: the
backend switches (backend.py, read here), the run's model and its random numbers (the copy is
built on the meta device and runs in eval mode on zeros: it draws none).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm  # every batch norm: 1d-3d, Sync, Lazy

log = logging.getLogger(__name__)

# The thread of this process's run, until waited for: the cuDNN caches it fills are the process's.
_running: threading.Thread | None = None
# What this process had timed ahead already (a sweep's later jobs in it): its caches still hold it.
_timed: set[tuple] = set()


def begin(
    build: Callable[[], nn.Module],
    device: torch.device,
    shapes: list[tuple[int, ...]],
    dtype: Callable[[], torch.dtype | None],
    layout: torch.memory_format,
    settings: tuple,
) -> None:
    """Where cuDNN autotunes on CUDA (torch.backends.cudnn.benchmark as the backend switches
    left it): a thread trains a copy of the model one step on zero images of each batch shape, in
    the run's autocast dtype (`dtype()`, asked in the thread; None: full precision) and memory
    `layout`. The copy is `build()` on the meta device, here (no random draws: its values do not
    decide cuDNN's choice), given memory and zeros in the thread; so it begins as soon as the
    data's classes are known, before the run's own model and its imports. Once per `settings`
    (what decides the convolutions' shapes and types) in a process."""
    global _running
    wait()
    if not autotunes(device) or settings in _timed:
        return
    _timed.add(settings)
    try:
        with torch.device("meta"), torch.random.fork_rng(devices=[]):
            twin = build()
    except Exception:  # a model.target the meta device cannot build: its warm-up autotunes it all
        log.debug("no copy of the model to autotune ahead on", exc_info=True)
        return
    arguments = (twin, device, shapes, dtype, layout)
    _running = threading.Thread(target=train_once, args=arguments, name="cudnn-ahead")
    _running.daemon = True  # a set-up that fails before the warm-up does not wait for it
    _running.start()


def autotunes(device: torch.device) -> bool:
    return device.type == "cuda" and torch.backends.cudnn.benchmark


def wait() -> None:
    """Until the thread is done, where one runs."""
    global _running
    if _running is not None:
        _running.join()
        _running = None


def train_once(
    twin: nn.Module,
    device: torch.device,
    shapes: list[tuple[int, ...]],
    dtype: Callable[[], torch.dtype | None],
    layout: torch.memory_format,
) -> None:
    """The copy in the run's precision itself, not under autocast: the convolutions are the ones
    autocast would run (their weights and inputs in that dtype, in `layout`; batch norm's weights
    and statistics in fp32, which autocast does not cast). autocast's cache of cast weights is
    one for the process, under one lock. Leaving autocast here cleared it, holding that lock, and
    freeing the cached weights waited for Python's lock; the main thread, tracing the model under
    autocast, held Python's lock and waited for the cache's. One H200 (torch 2.11.0+cu130,
    2026-11-28): 2 of 17 warm ResNet-18 runs hung in their warm-up."""
    try:
        on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with on_device:
            twin = twin.to_empty(device=device).eval()  # eval: no dropout's draws
            with torch.no_grad():
                for tensor in [*twin.parameters(), *twin.buffers()]:
                    tensor.zero_()
            precision = dtype() or torch.float32
            twin = twin.to(memory_format=layout, dtype=precision)
            for module in twin.modules():  # as autocast leaves them: batch norm's own in fp32
                if isinstance(module, _BatchNorm):
                    module.float()
            for shape in shapes:
                images = torch.zeros(shape, device=device, dtype=precision).contiguous(memory_format=layout)
                labels = torch.zeros(shape[0], dtype=torch.long, device=device)
                F.cross_entropy(twin(images).float(), labels).backward()  # into the copy's gradients
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    except Exception:  # the run's own first steps autotune what this did not
        log.debug("autotuning ahead failed; the warm-up autotunes itself", exc_info=True)


def shapes_to_time(batch_size: int, image_size: int, low_res: int, low_res_epochs: int) -> list[tuple]:
    """The training batches' shapes: data.low_res's first, where the run has low-res epochs."""
    sizes = ([low_res] if low_res and low_res_epochs else []) + [image_size]
    return [(batch_size, 3, size, size) for size in sizes]
