"""cuDNN's autotuning of the run's convolutions done ahead, beside the data's set-up.

With cudnn_benchmark=true cuDNN times its algorithms at the first convolution of each shape,
forward and backward, and a fresh process pays it inside its warm-up, one convolution after
another, while the GPU has idled through the set-up. torch keeps what it timed per thread
(cuDNN's plans are not safe to share between threads), and the two directions run on two
threads: a forward pass on the thread that calls it (the main thread, for the run), a backward
pass on autograd's thread for its device, whichever thread called it. So a copy of the model,
trained one step on zeros at each batch shape, has both timed where the run will look for them:

- its forward passes run on the main thread, while a thread of ours builds the data (torch lets
  go of Python's lock inside each operator: the two overlap). Before, the forward's timing was
  left to the warm-up. ResNet-18 (recipe=resnet18_94 step_graph=true, one H200, torch 2.11,
  medians of 4 taking turns, README "From Enter to result"): compile_s 2.70 s against 5.10 s
  and wall_s 18.8 s against 20.8 s on synthetic data; on CIFAR-10, whose cached data takes
  0.3-0.5 s to load and hides less of the forward's 0.9-1.0 s, compile_s 4.15 s against 5.68 s,
  setup_s 0.9 s longer, wall_s 22.9 s against 24.0 s; the fast CNN on CIFAR-10 (medians of 3):
  compile_s 1.07 s against 1.41 s, wall_s 6.94 s against 7.37 s. Synthetic images are drawn
  more slowly beside the forward (1.07 s against 0.84-0.98 s alone, profiled; why is not known):
  the fast CNN's synthetic runs took 0.5 s longer;
- its backward passes then run from a thread of ours, beside the rest of the set-up, the
  imports of torch.compile's compiler and its tracing. On one H100 (torch 2.11.0+cu130, batch
  2000 of 32x32 in bf16, channels_last), the first compiled backward took 0.01 s after them
  against 0.84 s without for the fast CNN, and 0.008 s against 0.94 s for ResNet-18 at batch 1024.

Not where a CUDA graph is captured while the thread runs: a capture forbids other threads'
allocations and synchronizations (torch.cuda.graph's default mode). `wait()` comes first in each
capture of ours and in the warm-up before its second step, where torch.compile's CUDA graphs
record.

Owns: which shapes are timed ahead, on what, on which thread, and when that is waited for. Must
not touch: the backend switches (backend.py, read here), the run's model and its random numbers
(the copy is built on the meta device and runs in eval mode on zeros: it draws none), the data
(built by the caller's function, only in another thread).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm  # every batch norm: 1d-3d, Sync, Lazy

log = logging.getLogger(__name__)
T = TypeVar("T")

# The backward passes' thread of this process's run, until waited for.
_running: threading.Thread | None = None
# The copy's class count, before the data says the run's: it sizes the classifier, a matmul cuDNN
# does not time (a model.target whose convolutions depend on it has those timed in its warm-up).
COPY_CLASSES = 10
# What this process had timed ahead already (a sweep's later jobs in it): its caches still hold it.
_timed: set[tuple] = set()


def beside(
    work: Callable[[], T],
    build: Callable[[int], nn.Module],
    device: torch.device,
    shapes: list[tuple[int, ...]],
    dtype: Callable[[], torch.dtype | None],
    layout: torch.memory_format,
    settings: tuple,
) -> T:
    """`work()`'s result (raising what it raised). Where cuDNN autotunes on CUDA
    (torch.backends.cudnn.benchmark as the backend switches left it), `work()` runs in a thread
    while this thread runs a copy of the model forward on zero images of each batch shape, in
    the run's autocast dtype (`dtype()`; None: full precision) and memory `layout`; then a thread
    runs their backward passes (`wait()` waits for it). The copy is `build(COPY_CLASSES)` on the
    meta device (no random draws: its values do not decide cuDNN's choice), given memory and
    zeros here. Once per `settings` (what decides the convolutions' shapes and types) in a
    process; elsewhere `work()` runs here, alone. The GPU is shared meanwhile: `work()`'s copies
    to it (data.loader=gpu) may fall inside a timing, which the runs measured did not show (the
    same images/s, README "From Enter to result")."""
    global _running
    wait()
    if not autotunes(device) or settings in _timed:
        return work()
    twin = meta_copy(build)
    if twin is None:
        return work()
    device = with_index(device)
    data = WorkThread(work, device)
    started = time.perf_counter()
    losses = forward_passes(twin, device, shapes, dtype, layout)
    timed = time.perf_counter() - started
    try:
        result = data.result()  # raises what work() raised, before a backward begins
    except BaseException:
        losses.clear()  # the copy's graphs, which the traceback would keep until a collection
        raise
    log.debug(
        "cuDNN's forward timing ahead took %.2f s, the data's set-up beside it %.2f s", timed, data.seconds
    )
    if losses:
        _timed.add(settings)
        _running = threading.Thread(target=backward_passes, args=(losses, device), name="cudnn-ahead")
        _running.daemon = True  # a set-up that fails before the warm-up does not wait for it
        _running.start()
    return result


def autotunes(device: torch.device) -> bool:
    return device.type == "cuda" and torch.backends.cudnn.benchmark


def wait() -> None:
    """Until the backward passes' thread is done, where one runs."""
    global _running
    if _running is not None:
        started = time.perf_counter()
        _running.join()
        _running = None
        log.debug("waited %.2f s for cuDNN's backward timing ahead", time.perf_counter() - started)


def meta_copy(build: Callable[[int], nn.Module]) -> nn.Module | None:
    """`build(COPY_CLASSES)` on the meta device with the random state put back after, or None
    where the meta device cannot build it."""
    try:
        with torch.device("meta"), torch.random.fork_rng(devices=[]):
            return build(COPY_CLASSES)
    except Exception:  # a model.target the meta device cannot build: its warm-up autotunes it all
        log.debug("no copy of the model to autotune ahead on", exc_info=True)
        return None


def with_index(device: torch.device) -> torch.device:
    """`cuda` as cuda:N, N the calling thread's current device: another thread's is its own (0)."""
    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_initialized() else 0)


class WorkThread(Generic[T]):
    """`work()` in a thread of its own, `device` its current CUDA device; `result()` waits.
    Why not concurrent.futures' thread pool, whose futures hand results and exceptions over
    alike: its threads are joined at the interpreter's exit, so a set-up interrupted by Ctrl-C
    would wait there for the data it no longer needs (the decoding of every image, on a first
    run); this thread is a daemon."""

    def __init__(self, work: Callable[[], T], device: torch.device):
        self.outcome: tuple[bool, object] | None = None
        self.seconds = 0.0  # work()'s, once done
        self.thread = threading.Thread(target=self.run, args=(work, device), name="set-up-data")
        self.thread.daemon = True  # an interrupted set-up does not wait for it
        self.thread.start()

    def run(self, work: Callable[[], T], device: torch.device) -> None:
        started = time.perf_counter()
        try:
            with cuda_device(device):
                self.outcome = (True, work())
        except BaseException as error:  # handed to the caller, which raises it
            self.outcome = (False, error)
        self.seconds = time.perf_counter() - started

    def result(self) -> T:
        """work()'s result once it is done; what it raised is raised here."""
        self.thread.join()
        (done, value), self.outcome = self.outcome, None
        if not done:
            raise value
        return value


def cuda_device(device: torch.device) -> contextlib.AbstractContextManager:
    """`device` as the current CUDA device inside, where it is one."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def forward_passes(
    twin: nn.Module,
    device: torch.device,
    shapes: list[tuple[int, ...]],
    dtype: Callable[[], torch.dtype | None],
    layout: torch.memory_format,
) -> list[torch.Tensor]:
    """The copy's loss at each shape, its graph kept for the backward. The copy in the run's
    precision itself, not under autocast: the convolutions are the ones autocast would run
    (their weights and inputs in that dtype, in `layout`; batch norm's weights and statistics
    in fp32, which autocast does not cast). autocast's cache of cast weights is one for the
    process, under one lock: a thread leaving autocast cleared it, holding that lock, and
    freeing the cached weights waited for Python's lock, while the main thread, tracing under
    autocast, held Python's lock and waited for the cache's. One H200 (torch 2.11.0+cu130,
    2026-11-28): 2 of 17 warm ResNet-18 runs hung in their warm-up."""
    losses = []
    try:
        with cuda_device(device):
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
                losses.append(F.cross_entropy(twin(images).float(), labels))
    except Exception:  # the run's own first steps autotune what this did not
        log.debug("autotuning the forward ahead failed; the warm-up autotunes itself", exc_info=True)
    return losses  # those of the shapes done


def backward_passes(losses: list[torch.Tensor], device: torch.device) -> None:
    try:
        with cuda_device(device):
            for loss in losses:
                loss.backward()  # into the copy's gradients
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    except Exception:
        log.debug("autotuning the backward ahead failed; the warm-up autotunes itself", exc_info=True)


def shapes_to_time(batch_size: int, image_size: int, low_res: int, low_res_epochs: int) -> list[tuple]:
    """The training batches' shapes: data.low_res's first, where the run has low-res epochs."""
    sizes = ([low_res] if low_res and low_res_epochs else []) + [image_size]
    return [(batch_size, 3, size, size) for size in sizes]
