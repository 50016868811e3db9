"""The model as the step calls it: channels_last -> DDP (trainer/perf/ddp.py) or DataParallel
-> torch.compile, in that order.

Must not touch: what the model is (trainer/models.py), the data and the step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from trainer import timing
from trainer.config import CompileMode, ConfigError, OptimizerName, TrainConfig
from trainer.perf.ddp import unused_ddp_toggles
from trainer.perf.graphed import CudaGraphed
from trainer.perf.notes import cannot_act, say_once


def memory_format(cfg: TrainConfig) -> torch.memory_format:
    return torch.channels_last if cfg.channels_last else torch.contiguous_format


def data_parallel_count(cfg: TrainConfig, device: torch.device) -> tuple[int, int]:
    """(GPUs data_parallel=true splits over, GPUs there are from `device` on)."""
    available = torch.cuda.device_count() - (device.index or 0)
    return cfg.devices or available, available


def splits_over_gpus(cfg: TrainConfig, device: torch.device) -> bool:
    """Whether data_parallel=true splits batches over two or more GPUs of this process."""
    return cfg.data_parallel and device.type == "cuda" and data_parallel_count(cfg, device)[0] > 1


def data_parallel(cfg: TrainConfig, model: nn.Module, device: torch.device) -> nn.Module:
    """nn.DataParallel over `devices` GPUs from this one process (the comparison DDP is made against)."""
    if not cfg.data_parallel:
        return model
    if device.type != "cuda":
        cannot_act("data_parallel=true", f"it splits each batch over CUDA devices, device is {device}")
        return model
    count, available = data_parallel_count(cfg, device)
    if count > available:
        raise ConfigError(
            f"devices={count} for data_parallel=true but {available} GPU(s) from {device} on: "
            f"set devices={available} or fewer"
        )
    if count < 2:
        cannot_act("data_parallel=true", "one GPU: there is nothing to split the batch over")
        return model
    first = device.index or 0
    return nn.DataParallel(model, device_ids=list(range(first, first + count)))


class TrainingForward(nn.Module):
    """The step's forward: logits, their loss and how many of them were right, in one module, so
    that torch.compile takes the loss into the model's graph (with CUDA graphs, into its replay)
    instead of the host running it and its backward op by op. On 2 H100s at 256 images per GPU
    the loss, its backward and the count were a fifth of the host's time per step (`profile=true`,
    README "DDP"), and a step the host cannot issue faster than the GPUs run is the one that
    stops scaling."""

    def __init__(self, model: nn.Module, loss_fn: nn.Module):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model(images)
        return self.loss_fn(logits, labels), (logits.argmax(dim=1) == labels).sum()


def prepare_model(
    cfg: TrainConfig,
    model: nn.Module,
    loss_fn: nn.Module,
    device: torch.device,
    wrap_ddp: Callable[[nn.Module], nn.Module] | None,
    world_size: int,
    captured: bool = False,
) -> TrainingForward:
    """channels_last -> DDP or DataParallel -> compile. Returns what the training step calls:
    (images, labels) -> (loss, correct). `wrap_ddp` is None where no DistributedDataParallel
    wraps the model: one process, or ddp_sync=after_backward (trainer/perf/all_reduce.py
    averages the gradients then). `captured`: step_graph captures the step (trainer/perf/step_graph.py)."""
    model = model.to(device, memory_format=memory_format(cfg))
    if wrap_ddp is not None:
        model = wrap_ddp(model)
    else:
        unused_ddp_toggles(cfg, world_size)
    forward = TrainingForward(data_parallel(cfg, model, device), loss_fn)
    if cfg.compile:
        if device.type == "cpu":
            say_once(
                logging.WARNING,
                "compile=true on a CPU: compiling takes minutes before the first step (6 min for "
                "ResNet-18 on 2 cores), once per settings: a later run reads torch's caches. "
                "compile=false starts at once",
            )
        # Static shapes: training batches all have one size (the last partial one is dropped), or
        # two with data.low_res. One dynamic graph for both sizes halved ResNet-18's images/s
        # and doubled its warm compile (README, "From Enter to result").
        forward = torch.compile(forward, mode=compile_mode(cfg, device, captured), dynamic=False)
    return forward


def optimizer_compiler(cfg: TrainConfig, device: torch.device) -> Callable[[Callable], Callable] | None:
    """What wraps the arithmetic an optimizer of ours runs outside torch's own kernels (optim=muon's
    orthogonalization). Where the run asks for CUDA graphs on CUDA (step_graph=true, compile_mode=
    reduce_overhead or max_autotune) it is replayed as a CUDA graph of its own (trainer/perf/
    graphed.py); where compile_optimizer has it compiled (`compiles_optimizer`), it is compiled in
    the model's mode without torch.compile's CUDA graphs (those would overwrite the outputs of the
    model's graphs, still in use by the step)."""
    graphed = device.type == "cuda" and (
        cfg.step_graph or (cfg.compile and cfg.compile_mode in WITHOUT_CUDA_GRAPHS)
    )
    compile_step = None
    if compiles_optimizer(cfg, graphed):
        mode = CompileMode(compile_mode(cfg, device))
        mode = WITHOUT_CUDA_GRAPHS.get(mode, mode).value
        compile_step = partial(torch.compile, mode=mode, dynamic=False)
    if not graphed:
        return compile_step
    return lambda function: CudaGraphed(compile_step(function) if compile_step else function)


def compiles_optimizer(cfg: TrainConfig, graphed: bool) -> bool:
    """compile_optimizer, auto resolved: compiled with compile=true unless `graphed` (a CUDA graph
    replays it). Compiling fuses its some 20 small kernels a weight, whose launches a replay
    saves anyway, and its tracing is the costliest of the warm-up's after the model's. Replayed
    uncompiled, against compiled (2 H200s of one host, torch 2.11, 2026-11-28, README "From
    Enter to result"): ResNet-18 (step_graph=true, 6 runs each) warm compile_s 4.9 against 6.0 s
    (medians) at 0.9% fewer images/s; the fast CNN (recipe=fastcnn_94, 10 seeds each) 1.5
    against 1.9 s at 0.5% fewer."""
    if cfg.optim.name is not OptimizerName.muon:
        if cfg.compile_optimizer != "auto":
            cannot_act(
                f"compile_optimizer={str(cfg.compile_optimizer).lower()}",
                f"it acts on optim=muon's arithmetic, this run has optim={cfg.optim.name.value}",
            )
        return False
    if cfg.compile_optimizer != "auto":
        return cfg.compile_optimizer
    if cfg.compile and graphed:
        say_once(
            logging.INFO,
            "compile_optimizer=auto: optim=muon's arithmetic is replayed in a CUDA graph of its own "
            "uncompiled (compile_optimizer=true compiles it too: about 1%% more images/s for "
            "ResNet-18, about 1 s more warm-up)",
        )
    return cfg.compile and not graphed


def fresh_compile() -> None:
    """Before each job of a sweep that runs in a process other jobs ran in (the basic launcher's
    one process, a parallel sweep's reused workers): forget what they compiled. Each job then
    compiles its own model (from torch's on-disk caches, where warm), its CUDA graphs' memory
    goes with the job before, and no job meets dynamo's recompile limit, past which a job
    would run eagerly without a word beside compiled ones. Nothing in a process that has run no
    job yet: there is nothing to forget, and the reset still took 0.45-0.50 s before a sweep's
    first job on an H200 host (torch 2.11; a parallel sweep's workers and the basic launcher's
    process alike)."""
    if timing.runs_started() == 0:
        return
    torch._dynamo.reset()


# Under step_graph, the compile modes that record CUDA graphs of their own compile without them:
# a graph is not recorded inside another's capture, and the step's graph holds their kernels.
WITHOUT_CUDA_GRAPHS = {
    CompileMode.reduce_overhead: CompileMode.default,
    CompileMode.max_autotune: CompileMode.max_autotune_no_cudagraphs,
}


def compile_mode(cfg: TrainConfig, device: torch.device, captured: bool = False) -> str:
    """torch.compile's mode: reduce-overhead's CUDA graphs need CUDA, elsewhere the default mode."""
    if device.type != "cuda":
        quiet_no_cuda_runtime()
        if cfg.compile_mode is CompileMode.reduce_overhead:
            cannot_act("compile_mode=reduce_overhead", f"CUDA graphs need CUDA, device is {device}")
            return CompileMode.default.value
    if captured and cfg.compile_mode in WITHOUT_CUDA_GRAPHS:
        mode = WITHOUT_CUDA_GRAPHS[cfg.compile_mode]
        say_once(
            logging.INFO,
            "step_graph=true: compile_mode=%s compiles as %s, its kernels replayed in the step's CUDA graph",
            cfg.compile_mode.name,
            mode.name,
        )
        return mode.value
    return cfg.compile_mode.value


class NoCudaRuntimeFilter(logging.Filter):
    """Drops torch's "No CUDA runtime is found" and nothing else of its logger: Inductor imports
    torch.utils.cpp_extension, whose import says so wherever a CUDA toolkit folder exists, which
    a run off CUDA cannot act on; that logger's other warnings (compiler, ABI) still show."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No CUDA runtime is found")


def quiet_no_cuda_runtime() -> None:
    cpp_extension = logging.getLogger("torch.utils.cpp_extension")
    if not any(isinstance(known, NoCudaRuntimeFilter) for known in cpp_extension.filters):
        cpp_extension.addFilter(NoCudaRuntimeFilter())
