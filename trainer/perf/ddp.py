"""How the ranks average gradients (ddp_sync): DistributedDataParallel and its communication
toggles (ddp_comm_hook, ddp_bucket_cap_mb, ddp_gradient_as_bucket_view, ddp_static_graph), or
one all-reduce after backward (trainer/perf/all_reduce.py); whether optim=muon's work is shared
out over the ranks (ddp_shard_muon); one line for ddp_* toggles nothing reads.

Must not touch: launching ranks and the process group (trainer/distributed.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
from torch import nn

from trainer.config import DdpCommHook, DdpSync, OptimizerName, TrainConfig
from trainer.perf.notes import at_default, cannot_act, override_value

log = logging.getLogger(__name__)

# The ddp_* toggles, and which of them DistributedDataParallel itself reads (the others are
# read where the processes are launched).
DDP_TOGGLES = (
    "ddp_backend",
    "ddp_max_restarts",
    "ddp_sync",
    "ddp_comm_hook",
    "ddp_bucket_cap_mb",
    "ddp_gradient_as_bucket_view",
    "ddp_static_graph",
)

DDP_WRAPPER_TOGGLES = DDP_TOGGLES[3:]  # read by DistributedDataParallel alone


def changed_toggles(cfg: TrainConfig, names: tuple[str, ...]) -> list[str]:
    return [f"{name}={override_value(getattr(cfg, name))}" for name in names if not at_default(cfg, name)]


def unused_ddp_toggles(cfg: TrainConfig, world_size: int) -> None:
    """One line for the ddp_* toggles set away from their defaults where nothing reads them:
    without ddp=true, in a single process, or beside ddp_sync=after_backward (no wrapper)."""
    if not cfg.ddp:
        names, reason = DDP_TOGGLES, "ddp=false: no DistributedDataParallel"
    elif world_size == 1:
        names, reason = DDP_TOGGLES[2:], "one process: nothing to all-reduce"
    else:
        names, reason = (
            DDP_WRAPPER_TOGGLES,
            "ddp_sync=after_backward: no DistributedDataParallel to configure",
        )
    changed = changed_toggles(cfg, names)
    if changed:
        cannot_act(" / ".join(changed), reason)


def muon_share(cfg: TrainConfig, ranks) -> tuple[int, int] | None:
    """ddp_shard_muon: (this rank, the ranks) where it acts (trainer/muon_shard.py); None
    otherwise, with one line where it was set and cannot act."""
    if not cfg.ddp_shard_muon:
        return None
    default = at_default(cfg, "ddp_shard_muon")  # on by default: said at DEBUG where it cannot act
    if cfg.optim.name is not OptimizerName.muon:
        reason = f"optim={cfg.optim.name.value}: only Muon's work is shared out"
        cannot_act("ddp_shard_muon=true", reason, default=default)
        return None
    if ranks.world_size == 1:
        cannot_act("ddp_shard_muon=true", "one process: nothing to share out", default=default)
        return None
    return ranks.rank, ranks.world_size


def gradient_sync(cfg: TrainConfig, module: nn.Module) -> DdpSync:
    """ddp_sync, with auto resolved: after_backward, unless a toggle only DistributedDataParallel
    reads is set (the user asked for the wrapper) or the gradient is larger than one bucket,
    where the wrapper's per-bucket all-reduces overlap a backward long enough to hide them.

    after_backward is the default because the wrapped model compiles with a graph break at the
    wrapper's forward and the wrapper's work on the host every step: on 2 H100s (ResNet-18,
    perf=fast, 256 images per GPU) the wrapper ran at 47.7% per GPU, after_backward at 85.4%
    (README, "Scaling out")."""
    if cfg.ddp_sync is not DdpSync.auto:
        return cfg.ddp_sync
    if changed_toggles(cfg, DDP_WRAPPER_TOGGLES) or gradient_mb(module) > ONE_BUCKET_UP_TO_MB:
        return DdpSync.wrapper
    return DdpSync.after_backward


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


def gradient_mb(module: nn.Module) -> float:
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad) / 2**20


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
    size = gradient_mb(module)
    return float(math.ceil(size) + 1) if size <= ONE_BUCKET_UP_TO_MB else TORCH_BUCKET_MB


def one_compiled_graph(cfg: TrainConfig, module: nn.Module, bucket_mb: float) -> None:
    """With compile on and the whole gradient in one bucket, compile the model as one graph.

    torch.compile splits a DDP model's graph where DDP's buckets end (and after a small first
    bucket of about 1 MB), so that each bucket's all-reduce can start while backward goes on.
    With one bucket there is nothing to overlap, and the split only adds a second graph with
    eager work between the two: on 2 H200s (ResNet-18, 512 images per GPU, perf=fast, one call)
    one graph ran at 149.2k and 150.2k img/s, the split graph at 132.8k and 128.2k.
    Buckets smaller than the gradient keep the split. The switch is dynamo's, for this process
    (a rank is one)."""
    if cfg.compile and bucket_mb >= gradient_mb(module):
        torch._dynamo.config.optimize_ddp = False
        log.info("ddp: compiled as one graph (one gradient bucket: no all-reduce to overlap)")


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
    one_compiled_graph(cfg, module, bucket_mb)
    hook = comm_hook(cfg)
    if hook is not None:
        model.register_comm_hook(*hook)
    return model
