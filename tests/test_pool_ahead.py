"""A parallel sweep's pool started ahead (trainer/pool_ahead.py): the launcher reuses it, each
worker takes a GPU of its own as its home, and a sweep's workers, started ahead or not, run its
later jobs however much its earlier ones grew them (trainer/parallel_jobs.py, `keep_worker`)."""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
from pathlib import Path

import pytest
import torch
from conftest import restored_after_test
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from joblib import Parallel, delayed
from omegaconf import OmegaConf

from trainer import cuda_driver, forkserver, parallel_jobs, pool_ahead
from trainer.cli_checks import CONF_DIR
from trainer.config import register_schema


def launcher_config(n_jobs: int):
    register_schema()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=["hydra/launcher=parallel", f"hydra.launcher.n_jobs={n_jobs}"],
            return_hydra_config=True,
        )
    return cfg.hydra.launcher


def loky_settings(launcher) -> dict:
    """The launcher's Parallel kwargs, as Hydra makes them."""
    from hydra_plugins.hydra_joblib_launcher._core import process_joblib_cfg

    settings = instantiate(launcher).joblib
    settings["backend"] = "loky"
    process_joblib_cfg(settings)
    return settings


def test_the_launchers_pool_is_the_one_started_ahead():
    """hydra-joblib-launcher's own Parallel call, as it makes it from the same config, runs its
    jobs on the workers started ahead: none is started twice."""
    launcher = launcher_config(2)
    before = set(Path(tempfile.gettempdir()).glob("trainer-pool-*"))
    ahead = list(pool_ahead.warm_pool(launcher, gpus=0))
    try:
        assert len(set(ahead)) == 2  # one task per worker: each would take a home
        assert set(Path(tempfile.gettempdir()).glob("trainer-pool-*")) <= before  # the barrier's file
        jobs = Parallel(**loky_settings(launcher))(delayed(os.getpid)() for _ in range(4))
        assert set(jobs) <= set(ahead)
    finally:
        parallel_jobs.stop_workers()


_grown: list[bytearray] = []


def grow_and_wait() -> int:
    """A job whose worker keeps 400 MB more than after its first task, as a training job keeps
    CUDA's context, the data and torch's compiled code, and lasts past loky's check interval."""
    _grown.append(bytearray(400 * 2**20))
    time.sleep(1.2)
    return os.getpid()


def test_the_workers_started_ahead_run_the_later_jobs_too():
    """loky measures a worker's memory after its first task and replaces a worker that has grown
    300 MB beyond it since: after a task that takes a home, every first job would look like a
    leak, and the later jobs would start cold in new workers (2 H100s: 1.6 s more per job)."""
    pytest.importorskip("psutil", reason="loky checks its workers' memory only with psutil")
    launcher = launcher_config(2)
    ahead = set(pool_ahead.warm_pool(launcher, gpus=0))
    try:
        settings = loky_settings(launcher)
        first = Parallel(**settings)(delayed(grow_and_wait)() for _ in range(2))
        later = Parallel(**settings)(delayed(os.getpid)() for _ in range(4))
        assert set(first) == ahead and set(later) <= ahead
    finally:
        parallel_jobs.stop_workers()


def job(grow: bool) -> int:
    """A parallel sweep's job on the CPU, as the launcher runs it in a worker."""
    cfg = OmegaConf.create({"device": "cpu"})
    with parallel_jobs.job_resources(cfg, 2):
        return grow_and_wait() if grow else os.getpid()


def test_a_job_larger_than_the_first_keeps_its_worker():
    """Without a pool started ahead: a small first job, then one 400 MB larger (a sweep over
    models), and the worker still runs the sweep's later jobs."""
    pytest.importorskip("psutil", reason="loky checks its workers' memory only with psutil")
    settings = loky_settings(launcher_config(2))
    try:
        first = Parallel(**settings)(delayed(job)(False) for _ in range(2))
        Parallel(**settings)(delayed(job)(True) for _ in range(2))
        later = Parallel(**settings)(delayed(job)(False) for _ in range(4))
        assert set(later) <= set(first)
    finally:
        parallel_jobs.stop_workers()


def test_one_job_at_a_time_starts_no_pool():
    assert pool_ahead.warm_pool(launcher_config(1), gpus=0) is None


def test_nothing_starts_ahead_without_a_preloaded_server_or_a_gpu(monkeypatch):
    asked = []

    def started(device: str, deterministic: bool = False) -> bool:
        monkeypatch.setattr(pool_ahead, "_warming", None)
        composed = OmegaConf.create({"device": device, "deterministic": deterministic})
        composed.hydra = {"launcher": launcher_config(2)}
        pool_ahead.start_workers(composed)
        return pool_ahead._warming is not None

    def warm_pool(launcher, gpus, context):
        asked.append(context)
        return iter([1, 2])

    monkeypatch.setattr(pool_ahead, "warm_pool", warm_pool)
    monkeypatch.setattr(cuda_driver, "loaded", lambda: True)
    monkeypatch.setattr(forkserver, "starts_at_once", lambda: False)
    assert not started("auto")
    monkeypatch.setattr(forkserver, "starts_at_once", lambda: True)
    assert not started("cpu")
    assert started("cuda") and started("auto") and started("cuda:0", deterministic=True)
    assert asked == [True, True, False]  # deterministic jobs: the driver only, no convolution
    monkeypatch.setattr(cuda_driver, "loaded", lambda: False)
    assert not started("auto")


def held_home(folder, answers, release) -> None:
    answers.put(pool_ahead.free_gpu(2, folder))
    release.wait(30)  # holds the lock until the test has read every answer


def test_each_worker_takes_a_home_of_its_own(tmp_path):
    """Two GPUs: this process and one other each hold one; a third process finds none free."""
    assert pool_ahead.free_gpu(2, tmp_path) == 0
    context = multiprocessing.get_context("fork")
    answers, release = context.Queue(), context.Event()
    found = []
    processes = [context.Process(target=held_home, args=(tmp_path, answers, release)) for _ in range(2)]
    for process in processes:  # one after the other: the second asks while the first holds
        process.start()
        found.append(answers.get(timeout=30))
    release.set()
    for process in processes:
        process.join(timeout=30)
    assert found == [1, None]


def test_a_home_is_what_the_workers_cuda_sees_first_and_its_jobs_ask_for(monkeypatch):
    started = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(cuda_driver, "start_ahead", lambda: started.append(True))
    monkeypatch.setattr(parallel_jobs, "_worker_order", None)
    monkeypatch.setattr(parallel_jobs, "_last_gpu", None)
    restored_after_test(monkeypatch, "CUDA_VISIBLE_DEVICES")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    parallel_jobs.settle_on(2, 1)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1,0"
    assert started == [True]
    assert parallel_jobs._last_gpu == 1  # the first job's gpu_slot asks for it first
    assert parallel_jobs.cuda_index(2, 1) == 0


def test_a_worker_with_a_home_starts_cuda_there_before_its_first_job(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(pool_ahead, "_home", None)
    monkeypatch.setattr(parallel_jobs, "slot_folder", lambda: tmp_path)
    monkeypatch.setattr(parallel_jobs, "settle_on", lambda gpus, slot: calls.append(("home", slot)))
    monkeypatch.setattr(pool_ahead, "start_cuda_on_home", lambda: calls.append("cuda"))
    monkeypatch.setattr(forkserver, "follow_the_caller", lambda: None)
    arrivals = tmp_path / "arrivals"
    arrivals.touch()
    assert pool_ahead.take_home(2, str(arrivals), 1, context=True) == os.getpid()
    for _ in range(200):  # the context starts in a thread of its own
        if "cuda" in calls:
            break
        time.sleep(0.01)
    assert calls == [("home", 0), "cuda"]
    assert not arrivals.exists()  # the last task to leave removes the barrier's file
    pool_ahead.take_home(2, str(arrivals), 1)  # a worker keeps its home: nothing starts twice
    assert calls == [("home", 0), "cuda"]
