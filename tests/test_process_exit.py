"""How `python -m trainer` ends: the exit code the interpreter would give, and no teardown of
the interpreter after everything is written (trainer/process_exit.py)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import types

import pytest
from conftest import HANG_GUARD_S, SMALL, cli_environment

from trainer import process_exit
from trainer.perf import stop_compile_workers
from trainer.process_exit import exit_code_of


def seconds_to_run(command: list[str]) -> tuple[subprocess.CompletedProcess, float, float]:
    """(the finished process, its start and its end on the wall clock)."""
    started = time.time()
    finished = subprocess.run(command, capture_output=True, text=True, env=cli_environment())
    return finished, started, time.time()


def test_the_process_ends_right_after_metrics_json(tmp_path):
    """The run's process ends within a quarter of `import torch`'s time on this host after
    writing metrics.json (a ratio, so that a busy host slows both). Interpreter teardown took
    half of it: 0.8 s against 1.6 s on a 2-core CPU."""
    run_dir = tmp_path / "run"
    finished, _, ended_at = seconds_to_run(
        [sys.executable, "-m", "trainer", *SMALL, "device=cpu", f"hydra.run.dir={run_dir}"]
    )
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert json.loads((run_dir / "metrics.json").read_text())["status"] == "completed"
    after_metrics = ended_at - os.path.getmtime(run_dir / "metrics.json")
    _, started, imported = seconds_to_run([sys.executable, "-c", "import torch"])
    assert after_metrics < 0.25 * (imported - started), (after_metrics, imported - started)


def test_the_exit_code_is_the_one_the_interpreter_would_give(capsys):
    def stops(code):
        def main():
            raise SystemExit(code)

        return main

    def crashes():
        raise ValueError("broken")

    def interrupted():
        raise KeyboardInterrupt

    assert [exit_code_of(main) for main in (lambda: None, stops(None), stops(2))] == [0, 0, 2]
    assert exit_code_of(stops("a message")) == 1 and exit_code_of(crashes) == 1
    stderr = capsys.readouterr().err
    assert stderr.startswith("a message\nTraceback") and stderr.endswith("ValueError: broken\n")
    assert exit_code_of(lambda: 3) == 3 and exit_code_of(interrupted) == 130


def test_a_closed_stdout_or_a_ctrl_c_end_the_process_as_the_interpreter_would():
    """A closed stdout keeps the exit code; an uncaught Ctrl-C ends the process by SIGINT, so
    that a shell loop around the command stops too; a run's own 130 (stopped) stays 130."""
    code = "from trainer.process_exit import run; run(lambda: 3)"
    closed = subprocess.run(f"{sys.executable} -c '{code}' >&-", shell=True, env=cli_environment())
    assert closed.returncode == 3
    ctrl_c = "from trainer.process_exit import run\ndef main():\n    raise KeyboardInterrupt\nrun(main)"
    interrupted = subprocess.run([sys.executable, "-c", ctrl_c], capture_output=True, env=cli_environment())
    assert interrupted.returncode == -signal.SIGINT
    # a run that stopped on a signal and says so with 130 keeps its code
    stopped = "import sys\nfrom trainer.process_exit import run\nrun(lambda: sys.exit(130))"
    assert subprocess.run([sys.executable, "-c", stopped], env=cli_environment()).returncode == 130


def test_a_profiled_command_ends_through_the_interpreter_and_keeps_its_profile(tmp_path, monkeypatch):
    """`python -m cProfile -o FILE` writes FILE at the interpreter's exit, which os._exit would
    skip: under a profiler the process ends the interpreter's way. From Python 3.12 cProfile
    registers through sys.monitoring, where sys.getprofile() stays None: that is asked too."""
    script = tmp_path / "command.py"
    script.write_text("from trainer.process_exit import run\nrun(lambda: 4)\n")
    profile = tmp_path / "command.prof"
    command = [sys.executable, "-m", "cProfile", "-o", str(profile), str(script)]
    assert subprocess.run(command, env=cli_environment()).returncode in (0, 4)  # cProfile's own code
    assert profile.stat().st_size > 0

    profiler_id, debugger_id = 2, 0
    tools = {profiler_id: "cProfile"}
    monitoring = types.SimpleNamespace(DEBUGGER_ID=debugger_id, PROFILER_ID=profiler_id, get_tool=tools.get)
    monkeypatch.setattr(sys, "monitoring", monitoring, raising=False)
    assert process_exit.watched()
    tools.clear()
    assert not process_exit.watched() or sys.gettrace() is not None  # pytest's own tracer, if any


def test_compile_workers_are_stopped_in_a_thread_the_exit_waits_for(monkeypatch):
    stopped_in = []
    async_compile = types.SimpleNamespace(
        shutdown_compile_workers=lambda: stopped_in.append(threading.current_thread())
    )
    monkeypatch.setitem(sys.modules, "torch._inductor.async_compile", async_compile)
    thread = stop_compile_workers()
    thread.join()
    assert stopped_in == [thread] and not thread.daemon
    # in a process that runs a sweep's jobs the pool serves the next job: it is left running
    from trainer.perf import compile_workers as model

    monkeypatch.setattr(model, "_workers_serve_the_sweep", False)
    model.keep_compile_workers()
    assert stop_compile_workers() is None and stopped_in == [thread]
    monkeypatch.delitem(sys.modules, "torch._inductor.async_compile")
    assert stop_compile_workers() is None  # nothing compiled: no pool, no thread


def test_a_compile_pool_still_starting_after_the_warm_up_is_ended_not_waited_for(monkeypatch, caplog, capfd):
    """What a forked run met: its compile, from a warm cache, done before inductor's sidecar had
    imported torch. torch's own stop waits for those imports; the run's stop ends the sidecar,
    quietly (torch reads it as the stop it asked for). A pool that answered is stopped by torch,
    except at the end of the sweep it was kept for."""
    pytest.importorskip("triton")
    from torch._inductor import async_compile, config

    from trainer.perf import compile_workers
    from trainer.perf.compile_workers import stop_pool

    monkeypatch.setattr(config, "compile_threads", 2)
    caplog.set_level("INFO")

    def started_pool(wait_until_ready: bool):
        async_compile.AsyncCompile.warm_pool()
        if wait_until_ready:
            async_compile.AsyncCompile.wait_pool_ready()
        else:
            async_compile.AsyncCompile.use_process_pool()  # the readiness probe, as a compile sends it
        [pool] = async_compile._pool_set
        return pool

    began = time.perf_counter()
    answered = started_pool(wait_until_ready=True)
    ready_s = time.perf_counter() - began
    stop_pool(async_compile)
    assert answered.process.poll() == 0  # stopped by torch, not killed

    starting = started_pool(wait_until_ready=False)
    began = time.perf_counter()
    stop_pool(async_compile)
    assert starting.process.poll() == -signal.SIGKILL
    assert time.perf_counter() - began < ready_s / 2
    assert not async_compile._pool_set
    starting.read_thread.join(HANG_GUARD_S)  # torch's reader has seen the sidecar's end
    # torch's own loggers write to stderr ("SubprocPool unclean exit" had the kill come first)
    assert "SubprocPool" not in capfd.readouterr().err
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING]
    assert sum("still starting after the warm-up" in message for message in caplog.messages) == 1

    # a pool kept for a sweep's jobs, at the sweep's end: ended, not waited for, as quietly
    serving = started_pool(wait_until_ready=True)
    monkeypatch.setattr(compile_workers, "_workers_serve_the_sweep", True)
    compile_workers.end_sweep_pool()
    assert serving.process.poll() == -signal.SIGKILL
    assert not async_compile._pool_set
    serving.read_thread.join(HANG_GUARD_S)
    assert "SubprocPool" not in capfd.readouterr().err
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING]


def test_a_run_whose_compile_workers_are_slow_to_stop_says_how_long_it_waited(tmp_path, monkeypatch, caplog):
    """The stop runs beside the training; where it outlasts the training it delays
    metrics.json, and the run's log says by how much."""
    from conftest import compose_config

    from trainer import perf
    from trainer.trainer import Trainer

    class StillStopping:  # the stop, still running when the training is over
        def join(self) -> None:
            time.sleep(0.6)

    monkeypatch.setattr(perf, "stop_compile_workers", StillStopping)
    caplog.set_level("INFO")
    Trainer(compose_config(*SMALL, "device=cpu"), tmp_path / "run").fit()
    [line] = [message for message in caplog.messages if "compile workers to stop" in message]
    assert line.startswith("waited 0.") and (tmp_path / "run" / "metrics.json").is_file()


@pytest.mark.parametrize("launched_here", [True, False])
def test_a_sweep_job_keeps_the_compile_workers_where_its_process_runs_the_next_job(
    tmp_path, monkeypatch, launched_here
):
    """The basic launcher's process runs every job of its sweep: the pool serves the next one. A
    job in a process of its own (a Slurm launcher's) stops it after its warm-up, as a run does."""
    from conftest import compose_config

    import trainer.__main__ as cli
    from trainer import sweep_summary
    from trainer.perf import compile_workers as model

    monkeypatch.setattr(model, "_workers_serve_the_sweep", False)
    monkeypatch.setattr(sweep_summary, "_sweep_dir", tmp_path if launched_here else None)
    overrides = ["device=cpu", "max_steps=1"]
    (tmp_path / "job").mkdir()
    cli.run(compose_config(*overrides), str(tmp_path / "job"), overrides, sweep_dir=str(tmp_path))
    assert (tmp_path / "job" / "metrics.json").is_file()
    assert model._workers_serve_the_sweep is launched_here


def test_the_end_of_a_sweep_ends_the_compile_pool_its_jobs_kept(monkeypatch, capsys):
    import trainer.__main__ as entry
    from trainer import sweep_summary

    ended = []
    monkeypatch.setattr(sweep_summary, "outcome", lambda: ("2 jobs completed", 0))
    monkeypatch.setitem(
        sys.modules,
        "trainer.perf.compile_workers",
        types.SimpleNamespace(end_sweep_pool=lambda: ended.append(1)),
    )
    entry.end_of_sweep(0)
    assert ended == [1] and "2 jobs completed" in capsys.readouterr().out
    monkeypatch.delitem(sys.modules, "trainer.perf.compile_workers")  # no job ran in this process
    entry.end_of_sweep(0)
    assert ended == [1]
