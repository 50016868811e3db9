"""trainer.trial_fork: a trial forked from a process that imported the trainer once trains what a
fresh `python -m trainer` trains, says why it failed in the trainer's own line, and a trial at
its time limit takes everything it started along."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import HANG_GUARD_S, SMALL, cli_environment, ended, ends_soon, run_python

from trainer import forkserver as server
from trainer import inductor_preload, trial_fork, trials
from trainer.config import ModelConfig, ModelName
from trainer.forkserver import forkserver
from trainer.models import build_imports

DETERMINISTIC = [*SMALL, "data.train_size=96", "epochs=2", "eval_every=2", "deterministic=true"]


def losses(trial: trials.Trial) -> list[float]:
    return [epoch["train_loss"] for epoch in trial.metrics["history"]]


def test_a_forked_trial_trains_what_a_fresh_one_trains(tmp_path):
    forked = trial_fork.forked_trial(DETERMINISTIC, tmp_path / "forked")
    fresh = trials.run_trial(
        trials.trainer_command(DETERMINISTIC, tmp_path / "fresh"), tmp_path / "fresh", env=cli_environment()
    )

    assert forked.failure is None, forked.stderr[-2000:]
    assert fresh.failure is None, fresh.stderr[-2000:]
    assert losses(forked) == losses(fresh) and forked.metrics["test_acc"] == fresh.metrics["test_acc"]
    assert forked.metrics["status"] == "completed" and len(forked.metrics["history"]) == 2
    log = (tmp_path / "forked" / "output.log").read_text()
    assert "run folder:" in log and log == forked.stdout + forked.stderr
    assert (tmp_path / "forked" / "__main__.log").is_file()  # Hydra's job log, as in a fresh run
    assert trials.steady_numbers(forked)["img_per_s"] == forked.metrics["history"][1]["img_per_s"]


def test_a_forked_trial_that_fails_says_why_in_the_trainers_line(tmp_path):
    trial = trial_fork.forked_trial(["modle=cnn"], tmp_path / "run")

    assert trial.returncode == 2 and trial.metrics == {}
    assert trial.failure.startswith("failed: trainer: error: unknown config key 'modle'. Did you mean")


def test_a_forked_trial_at_its_time_limit_is_stopped_and_keeps_its_output(tmp_path):
    # 4 s: a forked trial starts without its imports, and trains on one core until the limit
    trial = trial_fork.forked_trial([*SMALL, "epochs=10000"], tmp_path / "run", timeout_s=4)

    assert trial.failure == "timed out after 4 s" and trial.metrics == {}
    assert (tmp_path / "run" / "output.log").read_text() == trial.stdout + trial.stderr


def leave_a_process_behind(pid_file: str) -> None:
    """A trial's first line, then a process it starts and does not wait for (as inductor's
    compile workers or loader workers outlive a trial that ends without its teardown)."""
    os.setsid()
    left = subprocess.Popen(["sleep", "600"])
    Path(pid_file).write_text(str(left.pid))


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_what_a_trial_leaves_running_is_stopped_with_it(tmp_path):
    pid_file = tmp_path / "left.pid"
    trial = multiprocessing.get_context("fork").Process(target=leave_a_process_behind, args=(str(pid_file),))
    trial.start()
    trial.join(HANG_GUARD_S)
    left = int(pid_file.read_text())
    assert trial.exitcode == 0 and not ended(left)

    trial_fork.stop_group(trial)
    assert ends_soon(left), f"process {left}, which the trial started, still runs after the trial was stopped"


# A model.target whose builder writes down the state a library would see inside the trial.
PROBE = """
import multiprocessing, os, sys, torch
def probe(num_classes):
    with open(os.environ["PROBE_OUT"], "a") as out:
        out.write(f"{multiprocessing.get_start_method()} {sys.stdout.line_buffering}\\n")
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, num_classes))
"""


def test_inside_a_forked_trial_a_library_finds_what_a_fresh_process_has(tmp_path, monkeypatch):
    (tmp_path / "trial_probe.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))  # the forked trial takes this process's sys.path
    monkeypatch.setenv("PROBE_OUT", str(tmp_path / "forked.txt"))
    probe = [*SMALL, "model.target=trial_probe:probe", "data.train_size=32", "max_steps=1"]
    forked = trial_fork.forked_trial(probe, tmp_path / "forked")
    fresh_run = tmp_path / "fresh"
    path = os.pathsep.join((str(tmp_path), cli_environment()["PYTHONPATH"]))
    environment = {"PYTHONPATH": path, "PROBE_OUT": str(tmp_path / "fresh.txt")}
    fresh = trials.run_trial(
        trials.trainer_command(probe, fresh_run), fresh_run, env=cli_environment(environment)
    )

    assert forked.failure is None and fresh.failure is None, forked.stderr[-2000:] + fresh.stderr[-2000:]
    seen = (tmp_path / "forked.txt").read_text().splitlines()
    assert seen == (tmp_path / "fresh.txt").read_text().splitlines() and seen[0] == "fork False"


# Run by exec in a process forked from the server (a function of this file would import the file,
# and with it what the file imports): which of the modules the server may preload the process
# has, how many files torch read to give its compile caches' keys (none where they came along),
# and whether it was left the NVML check the preload set for its import.
LOADED_MODULES = """
import builtins, os, sys
from pathlib import Path
loaded = " ".join(name for name in ("torch._inductor.compile_fx", "torchvision") if name in sys.modules)
read, real_open = [], builtins.open
builtins.open = lambda *args, **kwargs: read.append(args[0]) or real_open(*args, **kwargs)
try:
    codecache = sys.modules.get("torch._inductor.codecache")
    for key in ("torch_key", "triton_key") if codecache else ():
        getattr(codecache, key, lambda: None)()
finally:
    builtins.open = real_open
Path(OUT).write_text(f"{loaded}; files read for the keys: {len(read)}; NVML check: {os.environ.get(NVML)}")
"""


def loaded_modules(compiles: bool, out: Path, also: tuple[str, ...] = ()) -> str:
    variables = {"OUT": str(out), "NVML": inductor_preload.NVML_CHECK}
    child = forkserver(compiles, also).Process(target=exec, args=(LOADED_MODULES, variables))
    child.start()
    child.join(HANG_GUARD_S)
    assert child.exitcode == 0
    return out.read_text()


@pytest.fixture
def fresh_server():
    """This process's server stopped before and after the test: it starts with the test's
    preload (the first caller's decides, and an earlier test of this process may have started one)."""
    server.stop()
    yield
    server.stop()


def test_the_server_preloads_inductor_for_processes_that_compile_and_not_torchvision(tmp_path, fresh_server):
    loaded = "torch._inductor.compile_fx; files read for the keys: 0; NVML check: None"
    assert loaded_modules(True, tmp_path / "modules") == loaded


def test_the_server_preloads_what_the_trials_model_imports_as_it_is_built(tmp_path, fresh_server):
    also = build_imports(ModelConfig(name=ModelName.resnet18))
    assert also == ("torchvision",)
    assert build_imports(ModelConfig(name=ModelName.fastcnn)) == ()
    assert build_imports(ModelConfig(name=ModelName.resnet18, target="mine:net")) == ()
    loaded = "torch._inductor.compile_fx torchvision; files read for the keys: 0; NVML check: None"
    assert loaded_modules(True, tmp_path / "modules", also) == loaded


def test_after_the_preload_dynamo_has_its_backends_without_reading_packages_again():
    """Dynamo's first compile in a process looks among every installed package's entry points
    for backends; the preload does it once, for every process forked after it."""
    code = (
        "import importlib.metadata, torch; from trainer import inductor_preload\n"
        "def refused(*args, **kwargs): raise AssertionError('entry points read again')\n"
        "importlib.metadata.entry_points = refused\n"
        "print('inductor' in torch.compiler.list_backends())"
    )
    result = run_python(code)
    assert result.stdout.split() == ["True"], result.stderr[-2000:]


def test_no_server_is_forked_from_a_process_that_asked_cuda_anything():
    """torch marks every process forked after `torch.cuda.is_available()`, even on a host without
    a GPU (a run asks it when it picks its device): a server forked from such a process would
    hand the mark to every trial and rank. A fresh interpreter, so that this worker's past does
    not count."""
    code = (
        "import torch; from trainer import forkserver; before = forkserver.forks_unmarked(); "
        "torch.cuda.is_available(); print(before, forkserver.forks_unmarked(), torch.cuda.is_initialized())"
    )
    result = run_python(code)
    assert result.stdout.split() == ["True", "False", "False"], result.stderr[-2000:]


def test_a_process_whose_forks_torch_marks_does_not_hold_the_preload(monkeypatch):
    monkeypatch.setattr(server.multiprocessing.forkserver._forkserver, "_preload_modules", ["os"])
    monkeypatch.setattr(server.threading, "active_count", lambda: 1)
    monkeypatch.setattr(server, "forks_unmarked", lambda: True)
    assert server.holds_the_preload()
    monkeypatch.setattr(server, "forks_unmarked", lambda: False)
    assert not server.holds_the_preload()


def test_a_server_for_processes_that_compile_nothing_leaves_inductor_out(tmp_path, fresh_server):
    """A DDP run with compile=false: its ranks' server does not import what they would not use.
    A caller that compiles, once that server runs, gets it as it is (its processes import
    inductor themselves)."""
    nothing = "; files read for the keys: 0; NVML check: None"
    assert loaded_modules(False, tmp_path / "first") == nothing
    assert loaded_modules(True, tmp_path / "then") == nothing


@pytest.mark.skipif(not torch.cuda._is_compiled(), reason="torch's CUDA check: needs a torch built with CUDA")
def test_inductor_is_imported_with_torchs_cuda_check_answered_without_starting_cuda(monkeypatch):
    """torch 2.11's inductor asks torch.cuda.is_available() at import; its default answer starts
    CUDA (cudaGetDeviceCount), after which no forked process can use it (on an H100)."""
    started = []
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: started.append(1) or 0)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 2)
    monkeypatch.delenv(inductor_preload.NVML_CHECK, raising=False)
    with inductor_preload.cuda_checked_by_nvml():
        assert torch.cuda.is_available() and not started
    assert inductor_preload.NVML_CHECK not in os.environ
    torch.cuda.is_available()
    assert started  # outside, torch's default check: the one that starts CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a compiled trial on CUDA: needs a CUDA GPU")
def test_a_forked_trial_compiles_and_trains_on_cuda(tmp_path):
    """What the server preloads leaves CUDA to the trial, which compiles on it."""
    trial = trial_fork.forked_trial([*SMALL, "device=cuda", "compile=true"], tmp_path / "run")
    assert trial.failure is None, trial.stderr[-2000:]
    assert trial.metrics["status"] == "completed" and trial.metrics["compile_s"] > 0


def test_the_cuda_check_is_torchs_own_mark_of_a_child_forked_after_cuda_started(monkeypatch):
    assert not trial_fork.cuda_started_before_fork()  # this process never started CUDA
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    assert trial_fork.cuda_started_before_fork()


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_trial_forked_after_cuda_started_refuses_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(trial_fork, "cuda_started_before_fork", lambda: True)
    child = multiprocessing.get_context("fork").Process(
        target=trial_fork.trial_process, args=(SMALL, str(tmp_path))
    )
    with capsys.disabled():  # the child writes to file descriptor 2, as a forkserver's child does
        child.start()
        child.join(60)

    assert child.exitcode == 1
    assert (tmp_path / "stderr").read_text() == trial_fork.NO_CUDA_AFTER_FORK + "\n"


# A stop that comes after the server forked a process and before it was sent its work.
STOP_WHILE_STARTING = """
import multiprocessing.forkserver as server, os, signal, sys, time
from trainer import forkserver
forkserver.PRELOAD = ()  # the server's imports are not what is tested
class Stopped(BaseException):
    pass
def stop(_signal, _frame):
    raise Stopped
signal.signal(signal.SIGTERM, stop)
connect = server.connect_to_new_process
def connect_then_stop(fds):
    forked = connect(fds)
    os.kill(os.getpid(), signal.SIGTERM)
    return forked
server.connect_to_new_process = connect_then_stop
process = forkserver.forkserver().Process(target=time.sleep, args=(600,))
try:
    forkserver.start_process(process)
except Stopped:
    print(process.pid, flush=True)
    process.kill()
    process.join()
    print("stopped", file=sys.stderr)
"""


def test_a_stop_while_a_process_starts_comes_once_it_has_its_work_and_can_be_stopped(tmp_path):
    """Without the stop held, the child read half its work and printed `EOFError: Ran out of
    input` on the caller's terminal after the caller's last line, with no pid to stop it by."""
    stopped = run_python(STOP_WHILE_STARTING)
    assert stopped.returncode == 0 and stopped.stderr == "stopped\n", stopped.stderr
    assert stopped.stdout.strip().isdigit()  # the pid was known when the stop was raised


FORK_STARTED = """
import json, multiprocessing, os, sys
from trainer import forkserver
forkserver.PRELOAD, forkserver.COMPILING = tuple(sys.argv[1:]), ()
import json
forkserver.start(compiles=False)
pid = multiprocessing.forkserver._forkserver._forkserver_pid
with open(f"/proc/{pid}/cmdline") as server, open("/proc/self/cmdline") as this:
    spawned = server.read() != this.read()  # a new interpreter, not this command forked
process = forkserver.forkserver().Process(target=os._exit, args=(7,))
forkserver.start_process(process)
process.join()
print(json.dumps({"spawned": spawned, "exitcode": process.exitcode}))
"""


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="forking the server reads /proc (Linux)")
@pytest.mark.parametrize("preload", [["json"], ["json", "wave"]], ids=["held", "not-held"])
def test_a_process_that_holds_the_preload_forks_its_server_instead_of_spawning_one(tmp_path, preload):
    """A command forked from python -m trainer.serve holds every preloaded module: its server
    (a parallel sweep's workers come from it) is forked from it, not a new interpreter that
    imports them again. Either way the server forks working processes."""
    result = run_python(FORK_STARTED, *preload, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome == {"spawned": preload != ["json"], "exitcode": 7}
