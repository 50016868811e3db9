"""CUDA's start beside the set-up's imports: the context, cuDNN's and cuBLAS's libraries loaded
in a thread while the main thread imports dynamo and inductor, and the data is read (where cuDNN
autotunes, the main thread's first CUDA call, cuDNN's forward timing in autotune_ahead.py, waits
for this start).

A fresh process pays each once, at its first use: on one H100 (torch 2.11.0+cu130) starting
CUDA took 0.13-0.16 s, the first convolution's forward and backward (cuDNN's libraries) 0.16-0.17 s
and the first matmul (cuBLAS's) 0.09-0.13 s, all in the main thread, one after the other. torch
lets go of Python's lock inside each operator, so a thread can take them while the main thread
imports. With it, on one H200, the fast CNN's set-up took 3.18 s (2.80-4.13) against 3.64 s
(2.92-4.33), the data's part of it 0.70 s against 0.93 s: the copy to the GPU no longer waits for
CUDA's start (8 plain runs each, taking turns; README, "From Enter to result").

Owns: which CUDA work is done ahead, and when it is waited for. Must not touch: the backend
switches (backend.py, set before the thread starts), the model and the data.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F

from trainer.config import TrainConfig
from trainer.perf.compile_keys import nothing_to_wait_for
from trainer.perf.model import memory_format

log = logging.getLogger(__name__)
_one_at_a_time = threading.Lock()  # start_cuda's


def cuda_ahead(
    cfg: TrainConfig, device: torch.device, dtype: Callable[[], torch.dtype | None]
) -> Callable[[], None]:
    """On CUDA, a thread starts CUDA and loads cuDNN and cuBLAS with one small convolution (forward
    and backward) and one matmul in the run's precision (`dtype()`: the autocast dtype or None,
    asked in the thread, as amp_dtype=auto asks the GPU) and memory format; returns what waits
    for it (the assembly's end). Not under deterministic=true, whose switches a first
    convolution or matmul reads and whose runs are not about their start."""
    if device.type != "cuda" or cfg.deterministic:
        return nothing_to_wait_for
    arguments = (device, dtype, memory_format(cfg))
    thread = threading.Thread(target=start_cuda, args=arguments, name="cuda-start")
    thread.daemon = True  # joined by the assembly; a set-up that fails before does not wait
    thread.start()
    return thread.join


def make_current(device: torch.device) -> None:
    """cuda:N as the current device of this thread, for the streams and graphs the run makes.
    Not where CUDA has not started and N is 0: a process's current device is 0 once CUDA
    starts, and making it current here would start CUDA now, on the main thread, instead of
    beside the set-up's imports (`cuda_ahead`). A parallel sweep's worker sees its first job's
    GPU as cuda:0 (trainer/parallel_jobs.py, `cuda_index`); a later job of the worker on another
    GPU finds CUDA started, and that GPU made current."""
    if device.index is not None and (device.index != 0 or torch.cuda.is_initialized()):
        torch.cuda.set_device(device)


def start_cuda(
    device: torch.device, autocast_dtype: Callable[[], torch.dtype | None], layout: torch.memory_format
) -> None:
    """The context, cuDNN (forward; the backward runs on autograd's thread for the device, the
    thread the run's backward passes run on) and cuBLAS. Values are zeros: no random draw, so the
    run's seeds draw what they would without it. One start at a time in a process: a parallel
    sweep's worker starts CUDA on its home GPU before its first job (trainer/pool_ahead.py), and
    the job's own start, arriving while that one still ran, loaded the same libraries beside it:
    on 2 H100s the two took 1.26 s and 0.40 s side by side, against 0.75 s for one start alone.
    A start that waited finds the libraries loaded (0.009 s on one H100)."""
    with _one_at_a_time:
        _start_cuda(device, autocast_dtype, layout)


def _start_cuda(
    device: torch.device, autocast_dtype: Callable[[], torch.dtype | None], layout: torch.memory_format
) -> None:
    try:
        with torch.cuda.device(device):
            dtype = autocast_dtype() or torch.float32
            images = torch.zeros(8, 16, 16, 16, device=device, dtype=dtype)
            images = images.to(memory_format=layout).requires_grad_()
            weight = torch.zeros(16, 16, 3, 3, device=device, dtype=dtype, requires_grad=True)
            F.conv2d(images, weight, padding=1).sum().backward()
            matrix = torch.zeros(16, 16, device=device, dtype=dtype)
            torch.mm(matrix, matrix)
            torch.cuda.synchronize(device)
    except Exception:  # the run's own first use of CUDA reports what fails, in its own words
        log.debug("starting CUDA ahead failed; the set-up starts it itself", exc_info=True)
