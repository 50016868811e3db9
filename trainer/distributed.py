"""Process groups: launch workers from inside the run, or join the one torchrun made.

Launching from inside the Hydra job (rather than torchrun around Hydra) keeps one run
folder per run and makes `-m` sweeps safe: each job makes and tears down its own group.
The launch is torch.distributed.elastic's, the engine under torchrun, with a c10d rendezvous
on a free local port: a rank that fails ends every rank (SIGTERM, then SIGKILL after a grace
period), so no process outlives the run; with restarts the group starts again instead.

Owns: launching ranks (launch_ranks, launch), joining torchrun's group, process_group(),
the stop vote's side group and sums over ranks. Must not touch: what the ranks train (each
runs the Trainer it is given), the run folder (rank 0's Run writes it), the DDP wrapper's
toggles (trainer/perf/ddp.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from trainer import forkserver
from trainer.config import ConfigError, DdpBackend, TrainConfig, TrainerError
from trainer.console import elastic_logs_to
from trainer.models import build_imports
from trainer.torchrun_env import started_by_torchrun  # noqa: F401 - part of this module's interface

log = logging.getLogger(__name__)

# Seconds the ranks get to stop at a step and save after SIGTERM/SIGINT, before SIGKILL.
STOP_GRACE_S = 60
UNSHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
STOPPED_EXIT_CODE = 130  # a rank that stopped at a step and saved, as asked
ECHO_DELAY_S = 1.0  # how much later a rank that raised ends than one a signal ended (_elastic_worker)


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class WorkerFailed(TrainerError):
    def __init__(self, rank: int, reason: str):
        super().__init__(f"rank {rank} failed: {reason}")
        self.rank = rank


class LaunchStopped(TrainerError):
    """SIGINT or SIGTERM reached the launcher; the ranks were asked to stop and save."""


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


@contextlib.contextmanager
def process_group(cfg: TrainConfig, ranks: Ranks, device: torch.device) -> Iterator[None]:
    """Inside the group the caller made, or in one made here and torn down after."""
    if is_initialized():
        yield
        return
    init_process_group(backend_for(cfg, device.type), ranks, device)
    try:
        yield
    finally:
        destroy_process_group()


def all_reduce_sum(tensor: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    if ranks.world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


class StopVote:
    """Whether any rank has been asked to stop, answered alike on every rank at the same step.

    Each poll sends this rank's request, without waiting, on a gloo group of its own (CPU
    tensors: no device sync, whatever the backend) and returns the previous poll's sum: a
    step's work never waits for the vote, and a stop lands one step after it was asked.
    """

    def __init__(self, ranks: Ranks):
        self.group = dist.new_group(backend="gloo") if ranks.world_size > 1 else None
        self.pending: tuple | None = None

    def poll(self, requested: bool) -> bool:
        if self.group is None:
            return requested
        agreed = False
        if self.pending is not None:
            work, votes = self.pending
            work.wait()
            agreed = votes.item() > 0
        votes = torch.tensor([1.0 if requested else 0.0])
        self.pending = (dist.all_reduce(votes, group=self.group, async_op=True), votes)
        return agreed

    def close(self) -> None:
        """Wait for the last vote (every rank sent it), before the group can go."""
        if self.pending is not None:
            self.pending[0].wait()
            self.pending = None


def _elastic_worker(target: Callable, args: tuple, environment: dict[str, str]) -> object:
    """One rank, started by the elastic agent (which set RANK, WORLD_SIZE, LOCAL_RANK, ...), with
    the launcher's environment under what the agent set."""
    forkserver.take_environment(environment)
    forkserver.follow_the_caller()  # a launcher killed with SIGKILL takes its ranks along
    ranks = torchrun_ranks()
    # Without this, every CPU rank starts one thread per core and they fight (~60x slower).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    try:
        return target(ranks, *args)
    except TrainerError as error:  # the user's to fix: one line for the launcher, no traceback
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler

        get_error_handler().record_exception(error)
        sys.stderr.flush()
        sys.exit(1)
    except Exception:
        # The agent reports only the first rank it sees end. A rank whose collective broke is
        # most often the echo of another that died (kill -9, the OOM killer), and ranks forked
        # from the server (trainer/forkserver.py) have their ends relayed by it, both at once
        # as often as not: this one ends a moment later, so that the agent sees the cause first.
        time.sleep(ECHO_DELAY_S)
        raise


def restart_count() -> int:
    """How often the elastic agent has restarted this rank's group (0 on the first start)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def launch(
    world_size: int, target: Callable, args: tuple, max_restarts: int = 0, log_dir: Path | None = None
) -> object:
    """Run target(ranks, *args) in `world_size` processes on this host; return rank 0's result.

    A rank that dies restarts the whole group up to `max_restarts` times (the target sees
    restart_count() > 0). SIGINT/SIGTERM to this process reach the ranks, which stop at a step
    and save; then LaunchStopped is raised here. With `log_dir`, what the elastic agent logs
    (a failed rank's traceback) goes to the ranks' log files there instead of the terminal.
    """
    # The ranks are forked from the server that imported the trainer once, where the platform has
    # one: a rank, a restarted group or a sweep's next DDP job starts without importing torch again.
    start_method = forkserver.start_method()  # started now: its imports overlap the agent's set-up
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    error_files = tempfile.mkdtemp(prefix="trainer-elastic-")
    # Fields of newer torch releases (2.11's LaunchConfig has neither): passed where they exist.
    newer = {"signals_to_handle": "SIGTERM,SIGINT", "shutdown_timeout": STOP_GRACE_S}
    supported = {field.name for field in dataclasses.fields(LaunchConfig)}
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=f"trainer-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=max_restarts,
        monitor_interval=0.2,
        start_method=start_method,
        logs_specs=DefaultLogsSpecs(log_dir=error_files),
        **{name: value for name, value in newer.items() if name in supported},
    )
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    # A restarted group must not meet in the agent's rendezvous store: the killed group's
    # gloo addresses are still there, and a new rank that reads one first connects to a dead
    # port (seen here: connectFullMesh "Connection refused", or a hang). Unshared, rank 0 of
    # every attempt hosts a fresh store on a fresh port.
    shared_store = os.environ.get(UNSHARED_STORE)
    os.environ[UNSHARED_STORE] = "1"
    try:
        with elastic_logs_to(log_dir) if log_dir is not None else contextlib.nullcontext():
            return elastic_launch(config, _elastic_worker)(target, args, forkserver.environment_now())[0]
    except ChildFailedError as error:
        if all(failure.exitcode == STOPPED_EXIT_CODE for failure in error.failures.values()):
            raise LaunchStopped("the ranks stopped at a step, as asked") from None
        raise WorkerFailed(*_cause(error)) from None
    except SignalException as stop:
        raise LaunchStopped(f"stopped by {stop.sigval.name}") from None
    finally:
        for signum, handler in previous.items():  # the agent leaves its own handlers installed
            signal.signal(signum, handler)
        if shared_store is None:
            os.environ.pop(UNSHARED_STORE, None)
        else:
            os.environ[UNSHARED_STORE] = shared_store
        shutil.rmtree(error_files, ignore_errors=True)


def launch_ranks(cfg: TrainConfig, device_type: str, target: Callable, args: tuple, log_dir: Path) -> object:
    """ddp=true from one process: `world_size_for` ranks of target(ranks, *args), with
    ddp_max_restarts; settings no rank could run with are refused before any is started."""
    backend_for(cfg, device_type)
    world_size = world_size_for(cfg, device_type)
    log.info("ddp: launching %d processes (%s)", world_size, device_type)
    if forkserver.available():  # started for launch(): inductor preloaded only where the ranks compile
        forkserver.start(compiles=cfg.compile, also=build_imports(cfg.model))
    return launch(world_size, target, args, cfg.ddp_max_restarts, log_dir=log_dir)


def _trainer_error_names() -> set[str]:
    names, pending = set(), [TrainerError]
    while pending:
        cls = pending.pop()
        names.add(cls.__name__)
        pending.extend(cls.__subclasses__())
    return names


def _cause(error) -> tuple[int, str]:
    """The failure to report: a user error if a rank had one, else a rank ended by a signal
    (kill -9, the OOM killer), else the earliest; its message in one line. The others' broken
    collectives are their echo, and may be recorded before the agent notices a killed rank."""
    user_errors = _trainer_error_names()
    reports = []
    for rank, failure in error.failures.items():
        message = failure.message["message"] if isinstance(failure.message, dict) else failure.message
        kind, _, text = message.partition(": ")
        user = kind in user_errors
        line = ((text if user else message).strip() or f"exit code {failure.exitcode}").splitlines()[0]
        signalled = failure.exitcode < 0  # elastic's exit code for a process a signal ended
        reports.append((not user, not signalled, failure.timestamp, rank, line))
    *_, rank, message = min(reports)
    return rank, message
