"""Process groups: launch workers from inside the run, or join the one torchrun made.

Launching from inside the Hydra job (rather than torchrun around Hydra) keeps one run
folder per run and makes `-m` sweeps safe: each job makes and tears down its own group.
A rank that fails ends the whole run: the launcher terminates the others, then kills
what is left after a grace period, so no process outlives the run.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.config import ConfigError, DdpBackend, TrainConfig, TrainerError
from trainer.torchrun_env import started_by_torchrun  # noqa: F401 - part of this module's interface

log = logging.getLogger(__name__)

KILL_GRACE_S = 10.0


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class WorkerFailed(TrainerError):
    pass


def torchrun_ranks() -> Ranks:
    return Ranks(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))


def backend_for(cfg: TrainConfig, device_type: str) -> str:
    if cfg.ddp_backend is DdpBackend.auto:
        return "nccl" if device_type == "cuda" else "gloo"
    if cfg.ddp_backend is DdpBackend.nccl and device_type != "cuda":
        raise ConfigError("ddp_backend=nccl needs CUDA devices: use ddp_backend=gloo (or auto) on CPU")
    return cfg.ddp_backend.value


def world_size_for(cfg: TrainConfig, device_type: str) -> int:
    """How many processes `ddp=true` launches on this host."""
    if device_type == "cuda":
        available = torch.cuda.device_count()
        wanted = cfg.devices or available
        if wanted > available:
            raise ConfigError(
                f"devices={wanted} but this host has {available} GPU(s): set devices={available} or fewer"
            )
        return wanted
    if cfg.devices is None:
        raise ConfigError("ddp=true on CPU needs a process count: set devices=2 (or more)")
    return cfg.devices


def free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_process_group(backend: str, ranks: Ranks, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, rank=ranks.rank, world_size=ranks.world_size, **kwargs)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def destroy_process_group() -> None:
    if is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(tensor: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    if ranks.world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def _worker(rank: int, world_size: int, port: int, target: Callable, args: tuple, results) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    # Without this, every CPU rank starts one thread per core and they fight (~60x slower).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        results.put((rank, "ok", target(Ranks(rank, world_size, rank), *args)))
    except BaseException as error:  # noqa: BLE001 - reported to the launcher, then exit non-zero
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        if not isinstance(error, TrainerError):
            message = f"{type(error).__name__}: {message}"
            traceback.print_exc()
        results.put((rank, "error", message))
        sys.stderr.flush()
        os._exit(1)


def launch(world_size: int, target: Callable, args: tuple) -> object:
    """Run target(ranks, *args) in `world_size` fresh processes; return rank 0's result.

    Ctrl-C reaches the workers directly (same process group) and they stop together;
    SIGTERM to this process is passed on to them.
    """
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    port = free_port()
    processes = [
        context.Process(target=_worker, args=(rank, world_size, port, target, args, results), daemon=False)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    previous_term = signal.signal(signal.SIGTERM, lambda *_: _forward_sigterm(processes))
    try:
        return _supervise(processes, results)
    finally:
        signal.signal(signal.SIGINT, previous_int)
        signal.signal(signal.SIGTERM, previous_term)
        _terminate(processes)


def _supervise(processes: list, results) -> object:
    outcomes: dict[int, tuple[str, object]] = {}
    while True:
        while not results.empty():
            rank, status, payload = results.get()
            outcomes[rank] = (status, payload)
        failed = [p for p in processes if p.exitcode not in (None, 0)]
        if failed or all(p.exitcode == 0 for p in processes):
            break
        time.sleep(0.2)
    _terminate(processes)
    while not results.empty():
        rank, status, payload = results.get()
        outcomes[rank] = (status, payload)
    errors = [(rank, payload) for rank, (status, payload) in outcomes.items() if status == "error"]
    if errors:  # the first to fail is the cause; later ones are usually its echo (a broken collective)
        rank, message = errors[0]
        raise WorkerFailed(f"rank {rank} failed: {message}")
    if failed:
        codes = ", ".join(f"rank {processes.index(p)} exit code {p.exitcode}" for p in failed)
        raise WorkerFailed(f"a DDP worker died without a report ({codes})")
    return outcomes[0][1]


def _forward_sigterm(processes: list) -> None:
    """Workers stop at their next check, save a checkpoint and exit; the launcher waits."""
    for process in processes:
        if process.is_alive():
            process.terminate()


def _terminate(processes: list) -> None:
    """SIGTERM the live workers, then SIGKILL whatever is still there after the grace period."""
    alive = [p for p in processes if p.is_alive()]
    for process in alive:
        process.terminate()
    deadline = time.monotonic() + KILL_GRACE_S
    for process in alive:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in alive:
        if process.is_alive():
            process.kill()
            process.join()
