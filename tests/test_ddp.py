"""DDP on CPU: two gloo processes launched from inside the run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from conftest import SMALL, cli_environment, compose_config, read_metrics, run_cli, run_folders
from PIL import Image

from trainer import Trainer
from trainer.config import ConfigError

DDP = ["ddp=true", "devices=2"]


def model_tensors(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=False)["model"]


def test_two_ranks_of_half_the_batch_match_one_process(tmp_path):
    """Gradients are averaged over ranks, so 2 x 16 images per step is one step of 32
    (the cnn has no BatchNorm). Tolerance: float32 summation order, rtol 1e-5."""
    common = ["deterministic=true", "max_steps=4", "data.train_size=256"]
    single = Trainer(compose_config(*common, "batch_size=32"), tmp_path / "single").fit()
    double = Trainer(compose_config(*common, *DDP, "batch_size=16"), tmp_path / "ddp").fit()
    assert (single["steps"], double["steps"]) == (4, 4)
    assert double["world_size"] == 2 and double["status"] == "completed"
    reference, distributed = model_tensors(tmp_path / "single"), model_tensors(tmp_path / "ddp")
    for name, tensor in reference.items():
        torch.testing.assert_close(distributed[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    # only rank 0 writes TensorBoard, checkpoints and metrics; rank 1 logs to its own file
    assert len(list((tmp_path / "ddp" / "tb").glob("events.*"))) >= 1
    assert (tmp_path / "ddp" / "rank1.log").is_file()
    assert not (tmp_path / "ddp" / "rank1").exists()


def test_evaluation_counts_every_test_image_once(tmp_path):
    """129 test images over 2 ranks (65 + 64): the reduced accuracy equals one process
    evaluating the same weights on all 129."""
    metrics = Trainer(compose_config(*DDP, "data.test_size=129", "max_steps=2"), tmp_path).fit()
    single = Trainer(compose_config("data.test_size=129"), tmp_path / "one").build()
    single.raw_model.load_state_dict(model_tensors(tmp_path))
    reference = single.evaluate()
    assert metrics["test_acc"] == reference["test_acc"]
    assert metrics["test_loss"] == pytest.approx(reference["test_loss"], rel=1e-5)


def count_gradient_syncs(ranks, config: dict, run_dir: str) -> tuple[int, int]:
    """In a launched rank: train with a comm hook that counts DDP's gradient all-reduces."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from trainer import distributed

    distributed.init_process_group("gloo", ranks, torch.device("cpu"))
    try:
        trainer = Trainer(config, run_dir, ranks=ranks).build(ranks)
        syncs = []

        def counting_hook(state, bucket):
            syncs.append(1)
            return default_hooks.allreduce_hook(state, bucket)

        trainer.ddp_model.register_comm_hook(None, counting_hook)
        trainer.fit()
        return len(syncs), trainer.progress.step
    finally:
        distributed.destroy_process_group()


def test_accumulation_skips_the_all_reduce_between_boundaries(tmp_path):
    """8 optimizer steps cost the same all-reduces with 1 or 4 micro-batches each: the
    3 non-boundary backward passes of every group do not synchronize."""
    from trainer.distributed import launch

    counts = {}
    for accum, images in ((1, 256), (4, 1024)):  # 8 steps of 16 x 2 ranks x accum images
        overrides = (*DDP, f"data.train_size={images}", "batch_size=16", f"grad_accum_steps={accum}")
        config = Trainer(compose_config(*overrides), tmp_path).config
        counts[accum] = launch(2, count_gradient_syncs, (config, str(tmp_path / str(accum))))
    assert counts[1][1] == counts[4][1] == 8  # optimizer steps
    assert counts[4][0] == counts[1][0] > 0  # all-reduces (one per bucket per step)


def test_ddp_sweep_makes_one_folder_per_job(tmp_path):
    """The issue's own example: each job makes and tears down its own process group."""
    result = run_cli(
        "-m",
        *SMALL,
        "ddp=false,true",
        "amp=false,true",
        "devices=2",
        cwd=tmp_path,
        env={"OMP_NUM_THREADS": "1"},
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
    """One rank hits an unreadable image; every process is gone within 60 s, the run exits
    non-zero and metrics.json says failed."""
    write_class_folders(tmp_path / "images", corrupt=True)
    tag = f"TRAINER_TEST_{uuid.uuid4().hex}"
    started = time.monotonic()
    result = run_cli(
        "model=cnn",
        "data=imagefolder",
        f"data.root={tmp_path / 'images'}",
        "batch_size=8",
        "epochs=1",
        *DDP,
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
        timeout=90,
        env={tag: "1", "OMP_NUM_THREADS": "1"},
    )
    assert time.monotonic() - started < 60
    assert result.returncode != 0
    metrics = read_metrics(tmp_path / "run")
    assert metrics["status"] == "failed"
    assert "rank" in metrics["error"] and "failed" in metrics["error"]
    assert "Traceback" not in result.stdout.splitlines()[-1]
    assert processes_tagged(tag) == []
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_ddp_resume_after_a_stop_matches_the_uninterrupted_run(tmp_path):
    args = [*SMALL, *DDP, "deterministic=true", "epochs=3", "data.train_size=512", "log_every=1"]
    args = [a for a in args if not a.startswith("epochs=1")]
    environment = cli_environment({"OMP_NUM_THREADS": "1"})
    stopped = tmp_path / "stopped"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "trainer", *args, f"hydra.run.dir={stopped}"],
        cwd=tmp_path,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # stop it once the first epoch is recorded
        if (stopped / "metrics.json").exists() and json.loads((stopped / "metrics.json").read_text())[
            "epochs"
        ] >= 1:
            break
        time.sleep(0.1)
    launcher.send_signal(signal.SIGTERM)
    output = launcher.communicate(timeout=120)[0].decode()
    assert launcher.returncode == 130, output[-2000:]
    assert read_metrics(stopped)["status"] == "interrupted"

    resumed = run_cli(
        *args,
        f"resume={stopped}",
        f"hydra.run.dir={tmp_path / 'resumed'}",
        cwd=tmp_path,
        env={"OMP_NUM_THREADS": "1"},
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    whole = run_cli(*args, f"hydra.run.dir={tmp_path / 'whole'}", cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert whole.returncode == 0
    final, reference = read_metrics(tmp_path / "resumed"), read_metrics(tmp_path / "whole")
    assert (final["status"], final["epochs"], final["steps"]) == ("completed", 3, reference["steps"])
    for name, tensor in model_tensors(tmp_path / "whole").items():
        torch.testing.assert_close(model_tensors(tmp_path / "resumed")[name], tensor, rtol=1e-5, atol=1e-6)


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


def torchrun(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    environment = cli_environment({"OMP_NUM_THREADS": "1"})
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "trainer", *args]
    return subprocess.run(command, cwd=cwd, env=environment, capture_output=True, text=True, timeout=180)


def test_torchrun_ranks_join_its_group_and_share_one_run_folder(tmp_path):
    result = torchrun(*SMALL, "ddp=true", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    [run] = run_folders(tmp_path / "outputs")
    metrics = read_metrics(run)
    assert (metrics["status"], metrics["world_size"]) == ("completed", 2)
    assert (run / "rank1.log").is_file() and (run / "checkpoints" / "last.pt").is_file()


def test_sweeps_under_torchrun_are_refused(tmp_path):
    result = torchrun("-m", *SMALL, "ddp=true", "seed=0,1", cwd=tmp_path)
    assert result.returncode != 0
    assert "sweeps (-m) under torchrun are not supported" in result.stderr
    assert not (tmp_path / "outputs").exists()
