"""torch.backends switches (deterministic, cudnn_benchmark, tf32), set before anything is
built, and the warm-up steps that the autotuning and compiling they lead to call for.

Must not touch: the model, the data, the step (the other files of trainer/perf/).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch

from trainer.config import TrainConfig
from trainer.perf.model import splits_over_gpus
from trainer.perf.notes import cannot_act, forget_said

log = logging.getLogger(__name__)


def apply_backend_flags(cfg: TrainConfig, device: torch.device) -> None:
    """torch.backends switches, set before anything is built (the first call of trainer/perf/ in
    a run)."""
    forget_said()
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        if cfg.cudnn_benchmark:
            log.info("cudnn_benchmark=true is overridden by deterministic=true")
    elif cfg.cudnn_benchmark:
        if device.type != "cuda":
            cannot_act("cudnn_benchmark=true", f"cuDNN is CUDA-only, device is {device}")
        torch.backends.cudnn.benchmark = not splits_over_gpus(cfg, device)
        if not torch.backends.cudnn.benchmark:
            # torch keeps cuDNN's autotuning results per thread, and DataParallel runs each
            # replica in a new thread every step: every step would autotune again. On 2 H200s
            # DataParallel ResNet-18 ran at 1.6k img/s with it and 16.5k without.
            cannot_act("cudnn_benchmark=true", "data_parallel=true would autotune every step again")
    torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
    torch.backends.cudnn.allow_tf32 = cfg.tf32
    if cfg.tf32 and device.type != "cuda":
        cannot_act("tf32=true", f"TensorFloat-32 is a CUDA matmul mode, device is {device}")


@contextlib.contextmanager
def heuristic_convolutions() -> Iterator[None]:
    """cuDNN's own choice of algorithm inside, without timing them (restored after)."""
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = before


def evaluation_backend(device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """What the evaluation runs under: where cuDNN autotunes (as apply_backend_flags left it),
    its heuristics instead. Autotuning repays its timing over the thousands of training steps of
    one shape; an evaluation runs each of its shapes (the batch, the last one, the TTA views of
    the unsure images) a few times per run, and timing them cost 0.3 s of each fresh process's
    warm-up (recipe=fastcnn_94, one H100, README "From Enter to result")."""
    if device.type == "cuda" and torch.backends.cudnn.benchmark:
        return heuristic_convolutions
    return contextlib.nullcontext


# Steps run before the clock starts when there is compiling or autotuning to do: CUDA graphs
# are recorded on the second call and the optimizer's fused kernel is built on the first.
WARM_UP_STEPS = 3


def warm_up_steps(cfg: TrainConfig, device: torch.device, captured: bool) -> int:
    """Steps to train (and undo) before the clock starts: where torch.compile, cuDNN's
    autotuning as apply_backend_flags left it, or step_graph's capture (`captured`) has work to
    do on the first shapes; else none."""
    autotuning = device.type == "cuda" and torch.backends.cudnn.benchmark
    return WARM_UP_STEPS if cfg.compile or autotuning or captured else 0


def warm_up_work(cfg: TrainConfig, device: torch.device, captured: bool) -> str:
    """What the warm-up steps are for, in the words of the run's log."""
    work = [f"torch.compile, {cfg.compile_mode.name}"] if cfg.compile else []
    if device.type == "cuda" and torch.backends.cudnn.benchmark:
        work.append("cuDNN autotuning")
    if captured:
        work.append("the step's CUDA graph captured")
    return "; ".join(work)
