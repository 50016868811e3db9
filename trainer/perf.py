"""Every optimization toggle is read and applied here, once, at build time.

Order for the model: activation checkpointing (in models.build_model) -> channels_last
-> DDP wrap (with its communication toggles) or DataParallel -> torch.compile. Where a
toggle cannot act on this device, one log line says so and the run carries on with it off.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from enum import Enum

import torch
from torch import nn

from trainer.config import AmpDtype, ConfigError, DdpCommHook, TrainConfig
from trainer.data import Normalizer

log = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]


_said: set[str] = set()  # what this run has said already (cleared by apply_backend_flags)


def say_once(level: int, message: str, *args) -> None:
    """A log line that a run prints once, however many of its parts reach the same decision."""
    line = message % args
    if line not in _said:
        _said.add(line)
        log.log(level, line)


def cannot_act(toggle: str, reason: str, *, default: bool = False) -> None:
    """One line per toggle and run: at INFO for a toggle the run asked for, at DEBUG for a
    default (pinned memory on a machine without CUDA is nothing the user chose)."""
    level = logging.DEBUG if default else logging.INFO
    say_once(level, "%s has no effect here (%s); carrying on without it", toggle, reason)


def at_default(cfg: TrainConfig, name: str) -> bool:
    return getattr(cfg, name) == TrainConfig.__dataclass_fields__[name].default


# Measured on a 2-core CPU with avx512_bf16 but no AMX: bf16 autocast ran the CNN at 63-73
# img/s against 838-985 in fp32. Without AMX's tile units, bf16 convolutions fall back to
# slow paths.
CPU_BF16_SLOWDOWN = "10-13x"


def cpu_has_amx() -> bool | None:
    """Whether the CPU lists AMX's bf16 tile units (amx_bf16); None where /proc/cpuinfo is absent."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return any(line.startswith("flags") and "amx_bf16" in line.split() for line in cpuinfo)
    except OSError:
        return None


# The ddp_* toggles, and which of them DistributedDataParallel itself reads (the others are
# read where the processes are launched).
DDP_TOGGLES = (
    "ddp_backend",
    "ddp_max_restarts",
    "ddp_comm_hook",
    "ddp_bucket_cap_mb",
    "ddp_gradient_as_bucket_view",
    "ddp_static_graph",
)
DDP_WRAPPER_TOGGLES = DDP_TOGGLES[2:]


def unused_ddp_toggles(cfg: TrainConfig) -> None:
    """One line for the ddp_* toggles set away from their defaults where no DistributedDataParallel
    reads them: without ddp=true, or with it in a single process."""
    names = DDP_WRAPPER_TOGGLES if cfg.ddp else DDP_TOGGLES
    changed = [f"{name}={override_value(getattr(cfg, name))}" for name in names if not at_default(cfg, name)]
    if changed:
        reason = "one process: nothing to all-reduce" if cfg.ddp else "ddp=false: no DistributedDataParallel"
        cannot_act(" / ".join(changed), reason)


def override_value(value: object) -> str:
    """A config value as it is written on the command line."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, bool):
        return str(value).lower()
    return format(value, "g") if isinstance(value, float) else str(value)


def apply_backend_flags(cfg: TrainConfig, device: torch.device) -> None:
    """torch.backends switches, set before anything is built (the first of this module's calls
    in a run)."""
    _said.clear()
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        if cfg.cudnn_benchmark:
            log.info("cudnn_benchmark=true is overridden by deterministic=true")
    elif cfg.cudnn_benchmark:
        if device.type != "cuda":
            cannot_act("cudnn_benchmark=true", f"cuDNN is CUDA-only, device is {device}")
        torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
    torch.backends.cudnn.allow_tf32 = cfg.tf32
    if cfg.tf32 and device.type != "cuda":
        cannot_act("tf32=true", f"TensorFloat-32 is a CUDA matmul mode, device is {device}")


# Steps run before the clock starts when there is compiling or autotuning to do: CUDA graphs
# are recorded on the second call and the optimizer's fused kernel is built on the first.
WARM_UP_STEPS = 3


def warm_up_steps(cfg: TrainConfig, device: torch.device) -> int:
    """Steps to train (and undo) before the clock starts: where torch.compile, or cuDNN's
    autotuning as apply_backend_flags left it, has work to do on the first shapes; else none."""
    autotuning = device.type == "cuda" and torch.backends.cudnn.benchmark
    return WARM_UP_STEPS if cfg.compile or autotuning else 0


def amp_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for full precision."""
    if not cfg.amp:
        return None
    if device.type == "cpu" and cpu_has_amx() is False:
        say_once(
            logging.WARNING,
            "amp=true on this CPU (no AMX: amx_bf16 is not among its flags) will be slower than fp32: "
            "bf16 autocast ran %s slower on such a CPU. Set amp=false here",
            CPU_BF16_SLOWDOWN,
        )
    if cfg.amp_dtype is AmpDtype.auto:
        cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if device.type == "cpu" or cuda_bf16 else torch.float16
    if cfg.amp_dtype is AmpDtype.fp16 and device.type == "cpu":
        cannot_act("amp_dtype=fp16", "fp16 autocast on CPU is ~100x slower; using bf16")
        return torch.bfloat16
    return torch.bfloat16 if cfg.amp_dtype is AmpDtype.bf16 else torch.float16


def autocast_context(
    cfg: TrainConfig, device: torch.device
) -> Callable[[], contextlib.AbstractContextManager]:
    dtype = amp_dtype(cfg, device)
    if dtype is None:
        return contextlib.nullcontext
    return functools.partial(torch.autocast, device_type=device.type, dtype=dtype)


def non_finite_remedy(cfg: TrainConfig, device: torch.device) -> str:
    """What else to try, after a lower learning rate, when the loss stops being finite."""
    dtype = amp_dtype(cfg, device)
    if dtype is None:
        return ""
    if dtype == torch.float16:
        return ", or use amp_dtype=bf16 / amp=false"
    return ", or set amp=false"


def grad_scaler(cfg: TrainConfig, device: torch.device) -> torch.amp.GradScaler:
    """Loss scaling only for fp16 on CUDA; a disabled scaler passes everything through."""
    enabled = amp_dtype(cfg, device) == torch.float16 and device.type == "cuda"
    return torch.amp.GradScaler(device.type, enabled=enabled)


def zero_grad(cfg: TrainConfig, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    return functools.partial(optimizer.zero_grad, set_to_none=cfg.set_to_none)


def optimizer_kwargs(cfg: TrainConfig) -> dict:
    """torch has fused SGD and AdamW kernels for CUDA and CPU."""
    return {"fused": True} if cfg.fused_optimizer else {}


def memory_format(cfg: TrainConfig) -> torch.memory_format:
    return torch.channels_last if cfg.channels_last else torch.contiguous_format


def leave_stops_to_the_main_process(_worker_id: int) -> None:
    """In each DataLoader worker. Ctrl-C and `kill -TERM -- -<pgid>` (terminals, job schedulers)
    reach every process of the group, and a worker that dies of them fails the run. A worker
    leaves for a process group of its own, so only the main process gets them: it stops at the
    next step, saves, and ends its workers itself (a SIGTERM sent to a worker still ends it)."""
    os.setpgid(0, 0)


def worker_count(cfg: TrainConfig, device: torch.device, processes_per_host: int) -> int:
    """num_workers, with auto resolved: 4 per GPU (enough to feed one at CIFAR sizes), capped
    by the cores each training process has less one for itself; 0 on a CPU device, whose
    training step already uses every core."""
    if cfg.num_workers != "auto":
        return cfg.num_workers
    if device.type != "cuda":
        return 0
    cores_per_process = len(os.sched_getaffinity(0)) // max(processes_per_host, 1)
    return max(0, min(4, cores_per_process - 1))


def dataloader_kwargs(cfg: TrainConfig, device: torch.device, processes_per_host: int = 1) -> dict:
    pin = cfg.pin_memory and device.type == "cuda"
    if cfg.pin_memory and not pin:
        cannot_act(
            "pin_memory=true",
            f"page-locked memory speeds copies to CUDA, device is {device}",
            default=at_default(cfg, "pin_memory"),
        )
    workers = worker_count(cfg, device, processes_per_host)
    if cfg.num_workers == "auto":
        level = logging.INFO if device.type == "cuda" else logging.DEBUG
        log.log(level, "num_workers=auto: %d worker processes", workers)
    kwargs = {"num_workers": workers, "pin_memory": pin}
    if workers > 0:
        kwargs["persistent_workers"] = cfg.persistent_workers
        kwargs["prefetch_factor"] = cfg.prefetch_factor
        kwargs["worker_init_fn"] = leave_stops_to_the_main_process
    elif cfg.persistent_workers or cfg.prefetch_factor is not None:
        cannot_act("persistent_workers / prefetch_factor", "num_workers=auto picked no workers")
    return kwargs


def batch_mover(cfg: TrainConfig, device: torch.device) -> Callable[[Batch], Batch]:
    """Host-to-device copy of a uint8 batch in the model's memory format, then conversion to
    normalized float there."""
    non_blocking = cfg.non_blocking and device.type == "cuda"
    if cfg.non_blocking and not non_blocking:
        cannot_act(
            "non_blocking=true",
            f"copies to {device} are synchronous",
            default=at_default(cfg, "non_blocking"),
        )
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


def comm_hook(cfg: TrainConfig) -> tuple[object, Callable] | None:
    """(state, hook) for DistributedDataParallel.register_comm_hook, or None for plain all-reduce."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if cfg.ddp_comm_hook is DdpCommHook.bf16:
        return None, default_hooks.bf16_compress_hook
    if cfg.ddp_comm_hook is DdpCommHook.fp16:
        return None, default_hooks.fp16_compress_hook
    if cfg.ddp_comm_hook is DdpCommHook.powersgd:
        # Rank 1 with error feedback is the paper's CIFAR setting; the first 10 steps all-reduce
        # in full while the optimizer leaves its most sensitive phase.
        state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=10)
        return state, powerSGD_hook.powerSGD_hook
    return None


TORCH_BUCKET_MB = 25.0  # DistributedDataParallel's own default
ONE_BUCKET_UP_TO_MB = 128


def bucket_cap_mb(cfg: TrainConfig, module: nn.Module) -> float:
    """ddp_bucket_cap_mb, with auto resolved for this model's gradient.

    auto puts a gradient of up to ONE_BUCKET_UP_TO_MB in one bucket: one all-reduce after
    backward instead of several beside it. On 2 H200s (NVLink, ResNet-18's 44.7 MB gradient,
    512 images per GPU, perf=fast) one bucket gave 91.9% per-GPU efficiency (91.4-92.4%, 3 runs)
    against 82.5% (75.5-87.7%) for torch's 25 MB buckets: the all-reduce itself takes 0.19 ms,
    the cost was the per-bucket work beside backward. Larger gradients keep torch's buckets, so
    that communication still overlaps a backward long enough to hide it."""
    if cfg.ddp_bucket_cap_mb != "auto":
        return float(cfg.ddp_bucket_cap_mb)
    gradient_mb = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad) / 2**20
    return float(math.ceil(gradient_mb) + 1) if gradient_mb <= ONE_BUCKET_UP_TO_MB else TORCH_BUCKET_MB


def distributed_data_parallel(
    cfg: TrainConfig, module: nn.Module, device: torch.device
) -> nn.parallel.DistributedDataParallel:
    """DDP with the ddp_* communication toggles, inside the process group the run is in."""
    bucket_mb = bucket_cap_mb(cfg, module)
    log.info("ddp: gradient buckets of %g MB (ddp_bucket_cap_mb=%s)", bucket_mb, cfg.ddp_bucket_cap_mb)
    model = nn.parallel.DistributedDataParallel(
        module,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=bucket_mb,
        gradient_as_bucket_view=cfg.ddp_gradient_as_bucket_view,
        static_graph=cfg.ddp_static_graph,
    )
    hook = comm_hook(cfg)
    if hook is not None:
        model.register_comm_hook(*hook)
    return model


def data_parallel(cfg: TrainConfig, model: nn.Module, device: torch.device) -> nn.Module:
    """nn.DataParallel over `devices` GPUs from this one process (the comparison DDP is made against)."""
    if not cfg.data_parallel:
        return model
    if device.type != "cuda":
        cannot_act("data_parallel=true", f"it splits each batch over CUDA devices, device is {device}")
        return model
    available = torch.cuda.device_count() - (device.index or 0)
    count = cfg.devices or available
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


def prepare_model(
    cfg: TrainConfig,
    model: nn.Module,
    device: torch.device,
    wrap_ddp: Callable[[nn.Module], nn.Module] | None,
) -> nn.Module:
    """channels_last -> DDP or DataParallel -> compile. Returns the module the training step calls."""
    model = model.to(device, memory_format=memory_format(cfg))
    if wrap_ddp is not None:
        model = wrap_ddp(model)
    else:
        unused_ddp_toggles(cfg)
    model = data_parallel(cfg, model, device)
    if cfg.compile:
        model = torch.compile(model, mode=cfg.compile_mode.value)
    return model


@dataclass
class Profiler:
    """torch.profiler over a few steps after warm-up; no-op when profile=false."""

    enabled: bool
    trace_dir: str
    warmup_steps: int = 5
    active_steps: int = 5

    def __post_init__(self) -> None:
        self.profiler = None
        if not self.enabled:
            return
        if not torch.cuda.is_available():
            # Writing the trace, kineto asks the CUDA driver for device properties even when only
            # CPU activity was recorded, and without a GPU prints "ERROR: ... gpuGetDeviceCount
            # failed" on stderr. Level 5 keeps its errors about GPUs out of a CPU run; it is read
            # when the profiler first starts in the process, and a value the user set stays.
            os.environ.setdefault("KINETO_LOG_LEVEL", "5")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                wait=0, warmup=self.warmup_steps, active=self.active_steps, repeat=1
            ),
            on_trace_ready=self._save,
        )
        self.profiler.start()

    def _save(self, profiler: torch.profiler.profile) -> None:
        torch.profiler.tensorboard_trace_handler(self.trace_dir)(profiler)
        sort_by = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        log.info(
            "profile: top ops over %d steps (trace in %s)\n%s",
            self.active_steps,
            self.trace_dir,
            profiler.key_averages().table(sort_by=sort_by, row_limit=15),
        )

    def step(self) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def stop(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
