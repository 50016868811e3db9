"""DDP on CPU: two gloo processes launched from inside the run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from conftest import (
    HANG_GUARD_S,
    SMALL,
    SWEEP_SMALL,
    cli_environment,
    compose_config,
    read_metrics,
    run_cli,
    run_folders,
)
from PIL import Image

from trainer import Trainer
from trainer.config import ConfigError, to_train_config
from trainer.distributed import LaunchStopped
from trainer.progress import Progress
from trainer.run import Run

DDP = ["ddp=true", "devices=2"]


def model_tensors(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=False)["model"]


# 4 steps of the cnn (no BatchNorm) on 2 ranks x 16 images, beside one process of 32 images a
# step; 129 test images, which 2 ranks split 65 + 64
HALVES = ["deterministic=true", "max_steps=4", "data.train_size=256", "data.test_size=129"]


@pytest.fixture(scope="module")
def halves(tmp_path_factory) -> tuple[Path, dict, Path, dict]:
    """(DDP run folder, its metrics, single-process run folder, its metrics): one launch
    serves both tests of gradient averaging and of the evaluation split."""
    root = tmp_path_factory.mktemp("halves")
    double = Trainer(compose_config(*HALVES, *DDP, "batch_size=16"), root / "ddp").fit()
    single = Trainer(compose_config(*HALVES, "batch_size=32"), root / "single").fit()
    return root / "ddp", double, root / "single", single


def test_two_ranks_of_half_the_batch_match_one_process(halves):
    """Gradients are averaged over ranks, so 2 x 16 images per step is one step of 32
    (the cnn has no BatchNorm). Tolerance: float32 summation order, rtol 1e-5."""
    ddp_dir, double, single_dir, single = halves
    assert (single["steps"], double["steps"]) == (4, 4)
    assert double["world_size"] == 2 and double["status"] == "completed"
    reference, distributed = model_tensors(single_dir), model_tensors(ddp_dir)
    for name, tensor in reference.items():
        torch.testing.assert_close(distributed[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    # only rank 0 writes TensorBoard, checkpoints and metrics; rank 1 logs to its own file
    assert len(list((ddp_dir / "tb").glob("events.*"))) >= 1
    assert (ddp_dir / "rank1.log").is_file()
    assert not (ddp_dir / "rank1").exists()


def test_evaluation_counts_every_test_image_once(halves, tmp_path):
    """129 test images over 2 ranks (65 + 64): the reduced accuracy equals one process
    evaluating the same weights on all 129."""
    ddp_dir, double, _, _ = halves
    single = Trainer(compose_config(*HALVES, "batch_size=32"), tmp_path / "one").build()
    single.raw_model.load_state_dict(model_tensors(ddp_dir))
    reference = single.evaluate()
    assert double["test_acc"] == reference["test_acc"]
    assert double["test_loss"] == pytest.approx(reference["test_loss"], rel=1e-5)


def count_gradient_syncs(ranks, configs: dict, run_dir: str) -> dict[int, tuple[int, int]]:
    """In a launched rank: train each config with a comm hook that counts DDP's gradient
    all-reduces; {key: (all-reduces, optimizer steps)}. One launch, one process group, for all."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from trainer import distributed

    distributed.init_process_group("gloo", ranks, torch.device("cpu"))
    try:
        counts = {}
        for key, config in configs.items():
            trainer = Trainer(config, f"{run_dir}/{key}", ranks=ranks).build(ranks)
            syncs = []

            def counting_hook(state, bucket, calls=syncs):
                calls.append(1)
                return default_hooks.allreduce_hook(state, bucket)

            trainer.ddp_model.register_comm_hook(None, counting_hook)
            trainer.fit()
            counts[key] = (len(syncs), trainer.progress.step)
        return counts
    finally:
        distributed.destroy_process_group()


def rank_environment(ranks, name: str) -> tuple[str | None, str, int]:
    """In a launched rank: the launcher's variable `name`, and what the agent set for this rank."""
    return os.environ.get(name), os.environ["RANK"], ranks.rank


def test_ranks_see_the_launchers_environment_of_now_and_their_own_rank(monkeypatch):
    """The ranks are forked from a server that started with the environment of its first launch
    (trainer/forkserver.py); a later launch's ranks still see the launcher's environment as it
    is then, and under it what the elastic agent set for each rank."""
    from trainer.distributed import launch

    name = "TRAINER_TEST_LAUNCH_" + uuid.uuid4().hex[:8].upper()
    monkeypatch.setenv(name, "first")
    assert launch(2, rank_environment, (name,)) == ("first", "0", 0)
    monkeypatch.setenv(name, "second")
    assert launch(2, rank_environment, (name,)) == ("second", "0", 0)
    monkeypatch.delenv(name)
    assert launch(2, rank_environment, (name,)) == (None, "0", 0)


@pytest.mark.parametrize(
    ("compiles", "model", "also"), [(False, "cnn", ()), (True, "resnet18", ("torchvision",))]
)
def test_the_ranks_server_preloads_inductor_only_for_a_run_that_compiles_and_what_its_model_imports(
    monkeypatch, compiles, model, also
):
    from trainer import distributed, forkserver

    started = []
    monkeypatch.setattr(forkserver, "start", lambda compiles, also: started.append((compiles, also)))
    monkeypatch.setattr(distributed, "launch", lambda *args, **kwargs: "launched")
    overrides = (*SMALL, "ddp=true", "devices=2", f"compile={str(compiles).lower()}", f"model={model}")
    cfg = to_train_config(compose_config(*overrides))
    assert distributed.launch_ranks(cfg, "cpu", rank_environment, (), log_dir=Path(".")) == "launched"
    assert started == ([(compiles, also)] if forkserver.available() else [])


def test_accumulation_skips_the_all_reduce_between_boundaries(tmp_path):
    """8 optimizer steps cost the same all-reduces with 1 or 4 micro-batches each: the
    3 non-boundary backward passes of every group do not synchronize."""
    from trainer.distributed import launch

    configs = {}
    for accum, images in ((1, 256), (4, 1024)):  # 8 steps of 16 x 2 ranks x accum images
        overrides = (
            *DDP,
            "ddp_sync=wrapper",  # the comm hook counts DistributedDataParallel's all-reduces
            f"data.train_size={images}",
            "batch_size=16",
            f"grad_accum_steps={accum}",
        )
        configs[accum] = Trainer(compose_config(*overrides), tmp_path).config
    counts = launch(2, count_gradient_syncs, (configs, str(tmp_path)))
    assert counts[1][1] == counts[4][1] == 8  # optimizer steps
    assert counts[4][0] == counts[1][0] > 0  # all-reduces (one per bucket per step)


def test_ddp_sweep_makes_one_folder_per_job(tmp_path):
    """A sweep over ddp and one more toggle: each job makes and tears down its own process group.
    The other toggle is channels_last, not amp: bf16 is slow on some CPUs and tests
    nothing here (22 s against 18 s on a 2-core AVX2 host)."""
    result = run_cli(
        "-m",
        *SWEEP_SMALL,
        "ddp=false,true",
        "channels_last=false,true",
        "devices=2",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    jobs = run_folders(tmp_path / "outputs")
    assert len(jobs) == 4
    world_sizes = sorted(read_metrics(job)["world_size"] for job in jobs)
    assert world_sizes == [1, 1, 2, 2]
    for job in jobs:
        assert read_metrics(job)["status"] == "completed"
        assert (job / "checkpoints" / "last.pt").is_file()


def write_class_folders(root: Path, corrupt: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    for split, count in (("train", 64), ("test", 16)):
        for label in range(2):
            folder = root / split / f"class{label}"
            folder.mkdir(parents=True)
            for index in range(count // 2):
                pixels = torch.randint(0, 256, (32, 32, 3), generator=generator, dtype=torch.uint8)
                Image.fromarray(pixels.numpy()).save(folder / f"{index}.png")
    if corrupt:
        (root / "train" / "class0" / "0.png").write_bytes(b"not a png")


def processes_tagged(tag: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if tag.encode() in (proc / "environ").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                pass
    return found


def test_a_failing_rank_ends_the_whole_run(tmp_path):
    """One rank hits an unreadable image; the run ends by itself, exits non-zero, metrics.json
    says failed and no process is left. Left to gloo, the other rank would wait 30 minutes
    in its next collective: the launch ends it instead (HANG_GUARD_S is far below that)."""
    write_class_folders(tmp_path / "images", corrupt=True)
    tag = f"TRAINER_TEST_{uuid.uuid4().hex}"
    result = run_cli(
        "model=cnn",
        "data=imagefolder",
        f"data.root={tmp_path / 'images'}",
        "batch_size=8",
        "epochs=1",
        *DDP,
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
        timeout=HANG_GUARD_S,
        env={tag: "1"},
    )
    assert result.returncode != 0
    metrics = read_metrics(tmp_path / "run")
    assert metrics["status"] == "failed"
    assert "rank" in metrics["error"] and "failed" in metrics["error"]
    assert "Traceback" not in result.stdout.splitlines()[-1]
    # one line on the terminal, elastic's report of the failed rank in that rank's log file
    [error] = [line for line in result.stderr.splitlines() if line.strip()]
    assert "[ERROR] - rank" in error and "ProcessExitedException" not in result.stdout + result.stderr
    assert processes_tagged(tag) == []
    assert not (tmp_path / "run" / "checkpoints").exists()


# 3 epochs of 16 steps on 2 ranks, deterministic: the reference for the stopped and the restarted run
THREE_EPOCHS = [
    *[a for a in SMALL if not a.startswith(("epochs=", "data.train_size="))],
    *DDP,
    "deterministic=true",
    "epochs=3",
    "data.train_size=1024",
    "log_every=1",
]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The reference, launched from here: the ranks are the same, only the launcher differs."""
    run_dir = tmp_path_factory.mktemp("whole") / "run"
    metrics = Trainer(compose_config(*THREE_EPOCHS, small=False), run_dir).fit()
    assert (metrics["status"], metrics["epochs"]) == ("completed", 3)
    return run_dir


def start_and_wait_for_epoch_one(args: list[str], run_dir: Path) -> subprocess.Popen:
    launcher = subprocess.Popen(
        [sys.executable, "-m", "trainer", *args, f"hydra.run.dir={run_dir}"],
        cwd=run_dir.parent,
        env=cli_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + HANG_GUARD_S
    # until the first epoch is recorded (and checkpointed), or the launcher has ended
    while launcher.poll() is None and time.monotonic() < deadline:
        metrics = run_dir / "metrics.json"
        if metrics.exists() and json.loads(metrics.read_text()).get("epochs", 0) >= 1:
            break
        time.sleep(0.02)
    return launcher


def assert_same_weights(run_dir: Path, reference: Path) -> None:
    final, expected = read_metrics(run_dir), read_metrics(reference)
    assert (final["status"], final["epochs"], final["steps"]) == ("completed", 3, expected["steps"])
    for name, tensor in model_tensors(reference).items():
        torch.testing.assert_close(model_tensors(run_dir)[name], tensor, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("status", ["interrupted", "completed", None])
def test_a_stop_that_finds_the_ranks_done_keeps_their_record(tmp_path, status):
    """The launcher was told to stop (LaunchStopped): rank 0's record of the stop, or of the
    finished run when the stop came after the last step, is what the run returns; with
    neither, the stop is an error, as before."""
    run = Run(to_train_config(compose_config(*DDP)), tmp_path, [], Progress())
    record = {"status": status, "steps": 48}

    def launch() -> dict:
        if status:
            (tmp_path / "metrics.json").write_text(json.dumps(record))
        raise LaunchStopped("the ranks stopped at a step, as asked")

    if status is None:
        with pytest.raises(LaunchStopped):
            run.launched_ranks(launch)
    else:
        assert run.launched_ranks(launch) == record and run.status == status


def test_a_record_from_before_the_launch_is_not_taken_for_the_ranks(tmp_path):
    """A metrics.json already there (an earlier attempt's) that the ranks did not rewrite leaves
    the stop an error, however close to the launch it was written."""
    run = Run(to_train_config(compose_config(*DDP)), tmp_path, [], Progress())
    (tmp_path / "metrics.json").write_text(json.dumps({"status": "completed", "steps": 48}))

    def launch() -> dict:
        raise LaunchStopped("the ranks stopped before writing anything")

    with pytest.raises(LaunchStopped):
        run.launched_ranks(launch)


def test_ddp_resume_after_a_stop_matches_the_uninterrupted_run(tmp_path, uninterrupted):
    stopped = tmp_path / "stopped"
    launcher = start_and_wait_for_epoch_one(THREE_EPOCHS, stopped)
    launcher.send_signal(signal.SIGTERM)
    output = launcher.communicate(timeout=HANG_GUARD_S)[0].decode()
    # On a stalled host the signal can come after the last step: the run is then complete.
    outcome = {130: "interrupted", 0: "completed"}
    assert launcher.returncode in outcome, output[-2000:]
    assert read_metrics(stopped)["status"] == outcome[launcher.returncode]

    resumed = run_cli(
        *THREE_EPOCHS,
        f"resume={stopped}",
        f"hydra.run.dir={tmp_path / 'resumed'}",
        cwd=tmp_path,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_same_weights(tmp_path / "resumed", uninterrupted)


def children(pid: int) -> list[tuple[int, bytes]]:
    """(pid, command line) of each child of `pid`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append((int(proc.name), (proc / "cmdline").read_bytes()))
        except OSError:
            pass
    return found


def launched_ranks(launcher_pid: int) -> list[int]:
    """The processes that run a rank, in pid order: the children of the launcher's forkserver
    (or, where the platform has none, the launcher's spawned children; not its other helpers)."""
    servers = [pid for pid, command in children(launcher_pid) if b"forkserver" in command]
    if servers:
        return sorted(pid for server in servers for pid, _ in children(server))
    return sorted(pid for pid, command in children(launcher_pid) if b"spawn_main" in command)


def test_a_killed_rank_restarts_the_group_from_the_last_checkpoint(tmp_path, uninterrupted):
    """kill -9 of one rank in epoch 2 of 3: with ddp_max_restarts=1 the elastic agent starts both
    ranks again, they resume from checkpoints/last.pt (epoch 1) and end where an uninterrupted
    run ends."""
    run_dir = tmp_path / "restarted"
    launcher = start_and_wait_for_epoch_one([*THREE_EPOCHS, "ddp_max_restarts=1"], run_dir)
    victims = launched_ranks(launcher.pid)
    assert len(victims) == 2
    os.kill(victims[-1], signal.SIGKILL)
    output = launcher.communicate(timeout=HANG_GUARD_S)[0].decode()
    assert launcher.returncode == 0, output[-3000:]
    assert "restart 1: resuming from" in (run_dir / "rank1.log").read_text()
    assert read_metrics(run_dir)["resumed_from"] == os.path.join("checkpoints", "last.pt")
    assert_same_weights(run_dir, uninterrupted)


def test_impossible_ddp_requests_are_config_errors(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="ddp=true on CPU needs a process count: set devices=2"):
        Trainer(compose_config("ddp=true"), tmp_path / "a").fit()
    with pytest.raises(ConfigError, match="ddp_backend=nccl needs CUDA"):
        Trainer(compose_config(*DDP, "ddp_backend=nccl"), tmp_path / "b").fit()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match="devices=3 but this host has 2 GPU"):
        Trainer(compose_config("ddp=true", "devices=3", "device=cuda"), tmp_path / "c").fit()
    assert read_metrics(tmp_path / "c")["status"] == "failed"


def test_the_reported_failure_is_the_cause_not_its_echo():
    """A rank's user error first; else a rank a signal ended, even when another rank's broken
    collective was recorded before the agent noticed it; else the earliest."""
    from types import SimpleNamespace

    from trainer.distributed import _cause

    def failure(message, exitcode, timestamp):
        return SimpleNamespace(message={"message": message}, exitcode=exitcode, timestamp=timestamp)

    echo = failure("RuntimeError: gloo: Connection closed by peer", 1, 10)
    killed = failure("Signal 9 (SIGKILL) received by PID 7", -9, 11)
    user = failure("ConfigError: set data.root=/path", 1, 12)
    assert _cause(SimpleNamespace(failures={0: echo, 1: killed})) == (
        1,
        "Signal 9 (SIGKILL) received by PID 7",
    )
    assert _cause(SimpleNamespace(failures={0: echo, 1: killed, 2: user})) == (2, "set data.root=/path")
    later = failure("RuntimeError: second", 1, 20)
    assert _cause(SimpleNamespace(failures={0: later, 1: echo})) == (
        1,
        "RuntimeError: gloo: Connection closed by peer",
    )
