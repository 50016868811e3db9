"""hydra/launcher=parallel on a CPU: jobs side by side in their own processes, a failing job
beside completing ones, a stop that keeps what was done and leaves no process, the report over
it; the GPU slots; and a sweep job that compiles afresh instead of falling back to eager."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import torch
from conftest import (
    HANG_GUARD_S,
    SWEEP_SMALL,
    all_end,
    cli_environment,
    compose_config,
    ends_soon,
    read_metrics,
    restored_after_test,
    run_cli,
    sweep_job,
)
from omegaconf import OmegaConf

from trainer import parallel_jobs
from trainer.parallel_jobs import cuda_visible, default_jobs, gpu_slot, nvml_gpu_count, threads_per_job
from trainer.sweep_summary import python_command

PARALLEL = ["-m", "hydra/launcher=parallel", "hydra.launcher.n_jobs=2"]
JOB_LOG = "__main__.log"  # Hydra names a job's log after the module it ran: as under the basic launcher


@pytest.fixture(scope="module")
def failing_sweep(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """Three jobs two at a time, the first two of 64 steps or more (long enough to overlap); the
    batch of job 2 is larger than the training set. The result's `ended_at`: the wall clock
    once the sweep's process had ended."""
    cwd = tmp_path_factory.mktemp("parallel")
    overrides = [*SWEEP_SMALL, "data.train_size=2048", "batch_size=16,32,4096", "hydra.sweep.dir=sweep"]
    result = run_cli(*PARALLEL, *overrides, cwd=cwd)
    result.ended_at = time.time()
    return cwd / "sweep", result


def test_a_failing_job_leaves_the_others_and_the_last_line_names_it(failing_sweep):
    folder, result = failing_sweep
    assert result.returncode == 1, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("sweep: 2 of 3 jobs completed; failed: 2_batch_size=4096 (batch_size=4096 ")
    for number in (0, 1):
        metrics = read_metrics(sweep_job(folder, number))
        assert (metrics["status"], metrics["device"]) == ("completed", "cpu")
        assert (sweep_job(folder, number) / "checkpoints" / "last.pt").is_file()
    assert read_metrics(sweep_job(folder, 2))["status"] == "failed"


def test_the_sweep_ends_right_after_its_last_job(failing_sweep):
    """The pool's workers are killed once every job has returned, not left to tear down their
    interpreters while the sweep waits: the sweep ends within half of `import torch`'s time on
    this host after the last metrics.json (a ratio; it took 1.1 s against 1.6 s on a 2-core CPU)."""
    folder, result = failing_sweep
    last_written = max(os.path.getmtime(sweep_job(folder, n) / "metrics.json") for n in range(3))
    started = time.time()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, env=cli_environment())
    import_torch = time.time() - started
    assert result.ended_at - last_written < 0.5 * import_torch, (result.ended_at - last_written, import_torch)


def log_span(job: Path) -> tuple[datetime, datetime]:
    """The first and last timestamps of a job's log."""
    stamps = [line[1:24] for line in (job / JOB_LOG).read_text().splitlines() if line.startswith("[")]
    first, last = (datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f") for stamp in (stamps[0], stamps[-1]))
    return first, last


def test_the_jobs_ran_side_by_side(failing_sweep):
    """Jobs 0 and 1 were running at the same time: one process could not have done that."""
    folder, _ = failing_sweep
    (start0, end0), (start1, end1) = (log_span(sweep_job(folder, n)) for n in (0, 1))
    assert start0 < end1 and start1 < end0


def test_the_report_reads_a_parallel_sweep(failing_sweep, tmp_path):
    folder, _ = failing_sweep
    result = run_cli(str(folder), cwd=tmp_path, module="trainer.report")
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in (folder / "report.md").read_text().splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| job | batch_size |")
    assert [row.split(" | ")[1] for row in rows[1:]] == ["16", "32", "4096"]
    assert rows[-1].endswith("| failed |")
    # the jobs shared the CPU's cores: one line says their images/s is below each one's alone
    assert read_metrics(sweep_job(folder, 0))["jobs_at_once"] == 2
    note = "img/s: every job ran 2 at a time on this host's CPU (hydra/launcher=parallel)"
    assert note in (folder / "report.md").read_text()


def probe_model(num_classes: int) -> torch.nn.Module:
    """model.target of a sweep whose jobs write down, in a worker of the pool (the sweep's own
    process builds the model too, for its checks), what they found in their process."""
    if multiprocessing.parent_process() is not None:
        forked_from = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
        with open(os.environ["PROBE_OUT"], "a") as out:
            out.write(f"{multiprocessing.get_start_method()} {torch.get_num_threads()} ")
            out.write(f"{b'multiprocessing.forkserver' in forked_from}\n")
    return linear_model(num_classes)


def test_the_workers_are_forked_from_the_preloaded_server_and_a_job_finds_a_fresh_process(tmp_path):
    """Named on the command line, the launcher forks its workers from the trainer's forkserver
    (its imports done as the sweep starts); a job still finds multiprocessing's default start
    method, as in a fresh process, and its share of the cores."""
    path = os.pathsep.join(filter(None, (str(Path(__file__).parent), cli_environment()["PYTHONPATH"])))
    probe = ["model.target=test_parallel_sweep:probe_model", "max_steps=1", "seed=0,1"]
    environment = {"PYTHONPATH": path, "PROBE_OUT": str(tmp_path / "probe.txt")}
    result = run_cli(*PARALLEL, *SWEEP_SMALL, *probe, "hydra.sweep.dir=sweep", cwd=tmp_path, env=environment)

    assert result.returncode == 0, result.stderr[-2000:]
    found = set((tmp_path / "probe.txt").read_text().splitlines())
    assert found == {f"fork {threads_per_job(2)} True"}


def test_ddp_inside_a_parallel_sweep_is_refused_before_any_job(tmp_path):
    """Refused in one line. The forkserver, which the sweep's process starts before its checks,
    ends with it: no process is left in the command's folder."""
    result = run_cli(*PARALLEL, *SWEEP_SMALL, "ddp=false,true", "devices=2", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("trainer: error: ddp=true inside hydra/launcher=parallel:")
    assert not (tmp_path / "outputs").exists()
    assert all_end(processes_in(tmp_path))


def processes_in(folder: Path) -> list[int]:
    """The processes whose working folder is `folder` (Linux)."""
    found = []
    for cwd in Path("/proc").glob("[0-9]*/cwd"):
        with contextlib.suppress(OSError):
            if cwd.resolve(strict=True) == folder.resolve():
                found.append(int(cwd.parent.name))
    return found


def descendants(pid: int) -> set[int]:
    """Every process under pid, from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, pending = set(), [pid]
    while pending:
        for child in children.get(pending.pop(), []):
            found.add(child)
            pending.append(child)
    return found


def in_bash(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """A printed line, pasted into bash as it stands."""
    return subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=cli_environment(), capture_output=True, text=True, timeout=300
    )


def assert_resumes(command: str, cwd: Path, run_dir: Path) -> None:
    """A pasted resume line starts a run that continues from the checkpoint; stopped once it
    has (what is left of the job would only repeat what the sweep's jobs did)."""
    resumed = subprocess.Popen(
        ["bash", "-c", command],
        cwd=cwd,
        env=cli_environment(),
        start_new_session=True,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    log = run_dir / JOB_LOG
    for _ in range(int(HANG_GUARD_S / 0.1)):
        text = log.read_text() if log.is_file() else ""
        if resumed.poll() is not None or ("resumed from" in text and "batches" in text):  # training
            break
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):  # it had ended
        os.killpg(resumed.pid, signal.SIGTERM)
    _, stderr = resumed.communicate(timeout=HANG_GUARD_S)
    assert resumed.returncode in (130, 0), stderr[-2000:]  # 0: it had finished first
    metrics = read_metrics(run_dir)
    assert metrics["resumed_from"] and metrics["status"] in ("interrupted", "completed")


def test_sigterm_stops_every_job_keeps_their_checkpoints_and_leaves_no_process(tmp_path):
    """Three jobs of 1,024 steps, two at a time; SIGTERM once both have begun training (the steps
    left after that outlast the two jobs' difference in start on a busy host)."""
    overrides = [*SWEEP_SMALL, "data.train_size=4096", "batch_size=4", "seed=0,1,2", "hydra.sweep.dir=sweep"]
    process = subprocess.Popen(
        [sys.executable, "-m", "trainer", *PARALLEL, *overrides],
        cwd=tmp_path,
        env=cli_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen: set[int] = set()
    for _ in range(600):  # until both running jobs have written a progress line
        seen |= descendants(process.pid)
        logs = list((tmp_path / "sweep").glob(f"*/{JOB_LOG}"))
        if len(logs) == 2 and all("batches" in log.read_text() for log in logs):
            break
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 130, stderr[-2000:]
    assert "stopped or not run: 0_seed=0, 1_seed=1, 2_seed=2" in stderr.strip().splitlines()[-1]
    for number in (0, 1):
        job = sweep_job(tmp_path / "sweep", number)
        assert read_metrics(job)["status"] == "interrupted"
        assert (job / "checkpoints" / "last.pt").is_file()
    assert not (sweep_job(tmp_path / "sweep", 2) / "metrics.json").exists()  # never started
    assert seen and all(ends_soon(pid) for pid in seen)
    # the printed hints work pasted into bash: the stopped job's resume, the sweep's report
    job = sweep_job(tmp_path / "sweep", 0)
    [hint] = [
        line.split("Continue with ", 1)[1]
        for line in (job / JOB_LOG).read_text().splitlines()
        if "Continue with" in line
    ]
    assert hint == f"\"resume='{job}'\""  # the folder's name holds '='
    job_overrides = " ".join(o for o in overrides if not o.startswith(("seed=", "hydra."))) + " seed=0"
    resume = f"{sys.executable} -m trainer {job_overrides} hydra.run.dir=resumed {hint}"
    assert_resumes(resume, tmp_path, tmp_path / "resumed")
    report = in_bash(stderr.strip().splitlines()[-1].split(" | ", 1)[1], tmp_path)
    assert report.returncode == 0, report.stderr[-2000:]
    assert (tmp_path / "sweep" / "report.md").is_file()


def test_a_sweep_killed_with_sigkill_takes_its_running_jobs_along(tmp_path):
    """No handler runs on SIGKILL to the sweep's process alone; its workers, forked from the
    trainer's server, end all the same (the server sees its caller gone, and they their server)
    instead of training on and taking the jobs still queued. The wait is only a hang guard."""
    overrides = [*SWEEP_SMALL, "epochs=100000", "seed=0,1,2", "hydra.sweep.dir=sweep"]
    process = subprocess.Popen(
        [sys.executable, "-m", "trainer", *PARALLEL, *overrides], cwd=tmp_path, env=cli_environment(),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        locks: list[Path] = []
        for _ in range(6000):  # until both running jobs hold their folders
            locks = [lock for lock in (tmp_path / "sweep").glob("*/run.lock") if lock.read_text().strip()]
            if len(locks) == 2 or process.poll() is not None:
                break
            time.sleep(0.1)
        assert len(locks) == 2, "the two jobs did not start"
        workers = [json.loads(lock.read_text())["pid"] for lock in locks]
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        assert all_end(workers), f"workers {workers} still run after the sweep was killed"
        assert not list((tmp_path / "sweep").glob("2_*"))  # the queued job never started
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


def test_the_report_hint_names_the_interpreter_a_pasted_line_runs(monkeypatch, tmp_path):
    here = os.path.abspath(sys.executable)
    monkeypatch.setattr(shutil, "which", lambda name: here)
    assert python_command() == "python"  # an activated venv, conda, the base interpreter
    other = tmp_path / "bin" / "python"  # another interpreter first on PATH
    other.parent.mkdir()
    other.symlink_to(here)
    monkeypatch.setattr(shutil, "which", lambda name: str(other))
    assert python_command() == shlex.quote(here)
    monkeypatch.setattr(shutil, "which", lambda name: None)  # no `python` at all
    assert python_command() == shlex.quote(here)


def test_each_job_holds_a_gpu_of_its_own(tmp_path):
    with gpu_slot(2, tmp_path) as first:
        with gpu_slot(2, tmp_path) as second:
            assert (first, second) == (0, 1)
        with gpu_slot(2, tmp_path) as again:
            assert again == 1  # freed, and 0 is still held
    with gpu_slot(2, tmp_path) as after:
        assert after == 0
    with gpu_slot(2, tmp_path, prefer=1) as preferred:
        assert preferred == 1
        with gpu_slot(2, tmp_path, prefer=1) as taken:
            assert taken == 0  # the preferred one is held


def test_a_workers_next_job_asks_first_for_the_gpu_its_last_job_ran_on(tmp_path, monkeypatch):
    """The worker's CUDA context and compiled graphs are on that GPU; another would start anew."""
    monkeypatch.setattr(parallel_jobs, "visible_gpus", lambda: 2)
    monkeypatch.setattr(parallel_jobs, "slot_folder", lambda: tmp_path)
    monkeypatch.setattr(parallel_jobs, "_last_gpu", None)
    monkeypatch.setattr(parallel_jobs, "_worker_order", None)
    restored_after_test(monkeypatch, "CUDA_VISIBLE_DEVICES")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    devices = []
    job = OmegaConf.create({"device": "auto"})
    # another job holds GPU 0 during this worker's first job
    with gpu_slot(2, tmp_path), parallel_jobs.job_resources(job, n_jobs=2) as (_, gpu):
        devices.append(gpu)
    with parallel_jobs.job_resources(OmegaConf.create({"device": "auto"}), n_jobs=2) as (_, gpu):
        devices.append(gpu)  # GPU 0 is free now
    assert devices == ["cuda:1", "cuda:1"]


def test_a_workers_cuda_sees_its_first_jobs_gpu_as_cuda_0(monkeypatch):
    """torch's compile caches key graphs by device index: on cuda:0 in every worker, a graph
    compiled on one GPU is read from the cache on the others."""
    started = [False]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: started[0])
    monkeypatch.setattr(parallel_jobs, "_worker_order", None)
    restored_after_test(monkeypatch, "CUDA_VISIBLE_DEVICES")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert parallel_jobs.cuda_index(4, 2) == 0
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,0,1,3"
    started[0] = True  # the worker's later jobs: CUDA keeps the order it started with
    assert [parallel_jobs.cuda_index(4, slot) for slot in range(4)] == [1, 2, 0, 3]

    monkeypatch.setattr(parallel_jobs, "_worker_order", None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a1,GPU-b2")  # the user's own choice, by name
    started[0] = False
    assert parallel_jobs.cuda_index(2, 1) == 0
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "GPU-b2,GPU-a1"

    monkeypatch.setattr(parallel_jobs, "_worker_order", None)
    started[0] = True  # CUDA already started in this process: it keeps the host's order
    assert parallel_jobs.cuda_index(2, 1) == 1


def test_cpu_jobs_share_the_cores_and_default_to_one_at_a_time():
    cores = len(os.sched_getaffinity(0))
    assert threads_per_job(2) == max(1, cores // 2)
    assert threads_per_job(64) == 1
    if not torch.cuda.is_available():
        assert default_jobs() == 1


def test_the_parents_gpu_count_reads_cuda_visible_devices_as_cuda_does():
    assert cuda_visible(8, None) == 8
    assert cuda_visible(8, "0,1") == 2
    assert cuda_visible(2, "1,0,5,0") == 2  # stops at the first index out of range
    assert cuda_visible(8, "") == 0 and cuda_visible(8, "-1") == 0
    assert cuda_visible(8, "2,,3") == 1
    assert cuda_visible(1, "GPU-8a1e,GPU-77c0") == 1  # names count as listed, never past the GPUs


def test_the_workers_server_leaves_inductor_to_the_jobs(monkeypatch):
    from trainer import forkserver

    asked = []
    monkeypatch.setattr(forkserver, "start_method", lambda compiles=True: asked.append(compiles) or "spawn")
    parallel_jobs.workers_from_forkserver()
    assert asked == [False]


def test_the_parent_counts_gpus_without_importing_torch():
    """The resolver runs in the sweep's parent before any job: it leaves torch unimported."""
    code = (
        "import sys; from trainer.parallel_jobs import default_jobs; n = default_jobs(); "
        "print(n, 'torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    jobs, torch_imported = result.stdout.split()
    assert int(jobs) >= 1
    if not Path("/proc/driver/nvidia").exists() or nvml_gpu_count() is not None:
        assert torch_imported == "False"
    if torch.cuda.is_available() and nvml_gpu_count() is not None:  # on a GPU host: torch's own count
        assert int(jobs) == torch.cuda.device_count()


def linear_model(num_classes: int) -> torch.nn.Module:
    """model.target of the compile test: the least there is to compile (the cnn took 15 s a
    compile on a CPU with torch's caches cold)."""
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, num_classes))


def compiled_job(run_dir: Path, batch_size: int, fresh: bool) -> dict:
    """One compiled run in this process, as a sweep job runs it: the frames dynamo was asked to
    compile and those it compiled (fewer: a job that ran eagerly)."""
    from torch._dynamo.utils import counters

    from trainer import Trainer
    from trainer.perf.model import fresh_compile

    if fresh:
        fresh_compile()
    before = dict(counters["frames"])
    overrides = ["model.target=test_parallel_sweep:linear_model", "compile=true", "max_steps=1"]
    overrides += ["data.train_size=64", "data.test_size=32"]
    Trainer(compose_config(*overrides, f"batch_size={batch_size}"), run_dir).fit()
    return {key: counters["frames"][key] - before.get(key, 0) for key in ("total", "ok")}


def test_a_sweep_job_compiles_afresh_where_it_would_have_run_eagerly(tmp_path):
    """With dynamo's recompile limit at 1 (torch's is 8: an ablation of more settings meets it),
    a second compiled job of another batch size in the same process runs eagerly, without a
    word, unless the job starts with fresh_compile, as every sweep job does."""
    import torch._dynamo

    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1):
        compiled_job(tmp_path / "a", 16, fresh=False)
        fallback = compiled_job(tmp_path / "b", 32, fresh=False)
        assert fallback["ok"] < fallback["total"], "the control: this job should have run eagerly"
        afresh = compiled_job(tmp_path / "c", 32, fresh=True)
        assert afresh["ok"] == afresh["total"] >= 1
    torch._dynamo.reset()


def test_a_process_that_has_run_no_job_has_nothing_to_forget(monkeypatch):
    """A sweep's first job in its process (a fresh worker, the basic launcher's first) skips
    dynamo's reset; every later one resets."""
    import torch._dynamo

    from trainer import timing
    from trainer.perf.model import fresh_compile

    resets = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(True))
    monkeypatch.setattr(timing, "_runs_started", 0)
    fresh_compile()
    assert resets == []
    monkeypatch.setattr(timing, "_runs_started", 1)
    fresh_compile()
    assert resets == [True]


def test_the_end_of_a_sweep_without_a_pool_starts_none(monkeypatch):
    """A basic sweep in a process that has loky imported (python -m trainer.serve preloads it)
    asks for no pool at its end: asking would start one, with loky's resource tracker."""
    from joblib.externals.loky import reusable_executor

    if reusable_executor._executor is not None:
        pytest.skip("a pool of this process's runs already")
    parallel_jobs.stop_workers()
    assert reusable_executor._executor is None


def test_the_end_of_a_parallel_sweep_kills_its_workers_and_every_process_under_them():
    """Under each worker, a process of its own (as inductor's compile workers are)."""
    from joblib.externals.loky import get_reusable_executor

    executor = get_reusable_executor(max_workers=1, reuse=False)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    grandchild = executor.submit(os.posix_spawn, sys.executable, sleeper, dict(os.environ)).result()
    worker = next(iter(executor._processes.values()))
    parallel_jobs.stop_workers()
    worker.join(timeout=10)
    assert not worker.is_alive()
    stat = Path(f"/proc/{grandchild}/stat")
    for _ in range(100):  # killed: gone, or a zombie until whoever took it in reaps it
        with contextlib.suppress(OSError):
            if stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":
                time.sleep(0.05)
                continue
        break
    else:
        raise AssertionError(f"process {grandchild} under the worker outlived the sweep's end")
