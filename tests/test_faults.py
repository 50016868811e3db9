"""The fault battery of issue 19 as a table: what a user or an operator does to a run (reads it
while it saves, starts a second run in its folder, fills the disk, kills or stops a rank) and
what must hold afterwards.

A row names its probe, a module fixture that does the thing once (rows that only look at
another side of the same outcome share it), and what must hold. Every row also holds: no
traceback anywhere in the output, the error (where the row expects one) is the last line on
stderr, and no temporary file is left in the run folder. Input faults (user model code, the
decode cache) have their own table in test_faults_inputs.py.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from conftest import HANG_GUARD_S, SMALL, all_end, cli_environment, compose_config, run_cli
from test_ddp import launched_ranks

from trainer import Trainer
from trainer.checkpoint import CHECKPOINT, load_checkpoint
from trainer.config import TrainerError
from trainer.logging import METRICS, RunLog

DDP = ["ddp=true", "devices=2"]
LONG = "epochs=1000"  # a run that goes on until the probe stops it
SAVES = 8  # R8: checkpoints the reader reads beside


@dataclass
class Outcome:
    run_dir: Path
    returncode: int | None = None  # None: the probe ran in this process
    stdout: str = ""
    stderr: str = ""  # in this process: the text of the error raised
    facts: dict = field(default_factory=dict)  # what else the probe saw


@dataclass(frozen=True)
class Row:
    probe: str  # a fixture giving an Outcome, or "fixture:key" of one giving a dict of them
    exit_code: int | None = None
    error: tuple[str, ...] = ()  # in the one error line: {run} is the run folder, {name} a fact
    metrics: dict = field(default_factory=dict)  # fields metrics.json holds afterwards
    check: Callable[[Outcome], None] | None = None  # what else must hold


def small(*changes: str) -> list[str]:
    """conftest.SMALL with these key=value overrides in place of its own."""
    keys = {change.partition("=")[0] for change in changes}
    return [arg for arg in SMALL if arg.partition("=")[0] not in keys] + list(changes)


# Every run start() launched: one a failed probe leaves running (LONG runs train for minutes) is
# ended with its ranks after this file, so that it cannot slow down or disturb what runs next.
STARTED: list[subprocess.Popen] = []


@pytest.fixture(scope="module", autouse=True)
def no_run_outlives_this_file():
    yield
    for process in STARTED:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def start(args: list[str], run_dir: Path, env: dict | None = None) -> subprocess.Popen:
    """`python -m trainer ARGS hydra.run.dir=run_dir` in a process group of its own, its output
    into files beside the folder."""
    with (
        open(run_dir.parent / f"{run_dir.name}.stdout", "w") as stdout,
        open(run_dir.parent / f"{run_dir.name}.stderr", "w") as stderr,
    ):
        STARTED.append(
            subprocess.Popen(
                [sys.executable, "-m", "trainer", *args, f"hydra.run.dir={run_dir}"],
                cwd=run_dir.parent,
                env=cli_environment(env),
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
            )
        )
        return STARTED[-1]


def finish(process: subprocess.Popen, run_dir: Path, **facts) -> Outcome:
    process.wait(timeout=HANG_GUARD_S)
    output = {name: (run_dir.parent / f"{run_dir.name}.{name}").read_text() for name in ("stdout", "stderr")}
    return Outcome(run_dir, process.returncode, output["stdout"], output["stderr"], facts)


def wait_for_epoch(process: subprocess.Popen, run_dir: Path) -> None:
    """Until the run has recorded (and checkpointed) its first epoch."""
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline and process.poll() is None:
        metrics = run_dir / METRICS
        if metrics.is_file() and json.loads(metrics.read_text()).get("epochs", 0) >= 1:
            return
        time.sleep(0.05)
    raise AssertionError(f"no epoch recorded in {run_dir} (exit code {process.poll()})")


def ended_process() -> int:
    """The pid of a process of this host that has ended."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


# ---------------------------------------------------------------------------- probes


@pytest.fixture(scope="module")
def reads_beside_saves(tmp_path_factory) -> Outcome:
    """R8: `load_checkpoint(run)` (what evaluate and resume do first) in a loop while the run
    saves a checkpoint every epoch."""
    run_dir = tmp_path_factory.mktemp("read-beside") / "run"
    process = start(small("data.train_size=64", "data.test_size=32", f"epochs={SAVES}"), run_dir)
    steps_read = []
    while process.poll() is None:
        if (run_dir / CHECKPOINT).is_file():
            steps_read.append(load_checkpoint(str(run_dir))[1]["step"])  # never unreadable, never refused
        else:
            time.sleep(0.01)
    return finish(process, run_dir, steps_read=steps_read)


@pytest.fixture(scope="module")
def live_folder(tmp_path_factory) -> dict[str, Outcome]:
    """R7: a folder left locked by a run that was killed is taken over by a new run; while that
    one trains, a second run, a resume into it and a Trainer from Python are refused."""
    folder = tmp_path_factory.mktemp("live") / "run"
    folder.mkdir()
    stale = ended_process()
    (folder / "run.lock").write_text(json.dumps({"pid": stale, "host": socket.gethostname()}))
    live = start(small(LONG, "seed=1"), folder)
    wait_for_epoch(live, folder)
    hydra_files = {path.name: path.read_bytes() for path in (folder / ".hydra").iterdir()}
    facts = {"owner": live.pid, "host": socket.gethostname(), "stale": stale}

    def refused(*args: str) -> Outcome:
        result = run_cli(*small(*args), f"hydra.run.dir={folder}", cwd=folder.parent)
        return Outcome(folder, result.returncode, result.stdout, result.stderr)

    with ThreadPoolExecutor(max_workers=2) as pool:  # as `for s in 1 2 3; do ... & done` starts them
        # the resume as the live run was started (seed=1): only the lock stands in its way
        second, resume = pool.map(
            lambda args: refused(*args), [("seed=2",), (LONG, "seed=1", f"resume={folder}")]
        )
    try:
        Trainer(compose_config("seed=3"), folder).fit()
        from_python = Outcome(folder)
    except TrainerError as error:
        from_python = Outcome(folder, stderr=str(error))
    untouched = {path.name: path.read_bytes() for path in (folder / ".hydra").iterdir()} == hydra_files
    live.send_signal(signal.SIGTERM)
    outcomes = {"second": second, "resume": resume, "python": from_python}
    for outcome in outcomes.values():
        outcome.facts = {**facts, "hydra_untouched": untouched}
    outcomes["live"] = finish(live, folder, **facts)
    return outcomes


@pytest.fixture(scope="module")
def closed_console(tmp_path_factory) -> dict[str, Outcome]:
    """R12: stdout piped into `head -1`, which leaves after one line, and stdout on /dev/full."""
    outcomes = {}
    for name, redirect in (("head", "| head -1 > /dev/null"), ("full", "> /dev/full")):
        cwd = tmp_path_factory.mktemp(f"console-{name}")
        command = f"{sys.executable} -m trainer {' '.join(SMALL)} epochs=2 hydra.run.dir=run {redirect}"
        result = subprocess.run(
            ["bash", "-c", f"{command}; exit ${{PIPESTATUS[0]}}"],
            cwd=cwd,
            env=cli_environment(),
            capture_output=True,
            text=True,
            timeout=HANG_GUARD_S,
        )
        outcomes[name] = Outcome(cwd / "run", result.returncode, result.stdout, result.stderr)
    return outcomes


def one_line_about_the_console(outcome: Outcome) -> None:
    assert len(lines(outcome.stderr)) == 1, outcome.stderr  # no `--- Logging error ---` blocks
    log = (outcome.run_dir / "__main__.log").read_text()
    assert "epoch 2/2 | step 16" in log  # the log file kept every line


def disk_fills_at_the_second_record(run_dir: Path, room: int) -> Outcome:
    """A run of 3 epochs whose files may grow to `room` bytes from its second metrics.json
    write on, the failure record included. facts["previous"]: metrics.json as that write found it."""
    write_metrics, found = RunLog.metrics, []  # metrics.json as each write finds it
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)

    def second_write_meets_a_full_disk(self, data):
        path = self.run_dir / METRICS
        found.append(path.read_text() if path.exists() else None)
        if len(found) == 2:
            resource.setrlimit(resource.RLIMIT_FSIZE, (room, limits[1]))
        write_metrics(self, data)

    error = ""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RunLog, "metrics", second_write_meets_a_full_disk)
        try:
            Trainer(compose_config("epochs=3", "data.train_size=64"), run_dir).fit()
        except TrainerError as raised:
            error = str(raised)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    return Outcome(run_dir, stderr=error, facts={"previous": found[1]})


@pytest.fixture(scope="module")
def final_record_on_a_nearly_full_disk(tmp_path_factory) -> Outcome:
    """R6: room for 700 bytes a file: less than the whole failure record with its history, more
    than its status and error."""
    return disk_fills_at_the_second_record(tmp_path_factory.mktemp("nearly-full-metrics") / "run", 700)


@pytest.fixture(scope="module")
def metrics_on_a_full_disk(tmp_path_factory) -> Outcome:
    """R6: the disk is full (a 64-byte file-size limit) when the second epoch's metrics.json
    is written; the limit stays for the rest of the run, its failure record included."""
    return disk_fills_at_the_second_record(tmp_path_factory.mktemp("full-metrics") / "run", 64)


@pytest.fixture(scope="module")
def evaluation_on_a_full_disk(tmp_path_factory, finished_run) -> Outcome:
    """R6: `python -m trainer.evaluate RUN` where evaluation.json cannot grow past 64 bytes."""
    run_dir = tmp_path_factory.mktemp("full-evaluation") / "run"
    shutil.copytree(finished_run, run_dir)
    previous = json.dumps({"test_acc": 0.5}) + "\n"
    (run_dir / "evaluation.json").write_text(previous)
    result = run_cli(str(run_dir), cwd=run_dir.parent, module="trainer.evaluate", file_size_limit=64)
    return Outcome(run_dir, result.returncode, result.stdout, result.stderr, {"previous": previous})


@pytest.fixture(scope="module")
def killed_rank(tmp_path_factory) -> Outcome:
    """R2 and R1: kill -9 of rank 1 once epoch 1 is recorded, without restarts
    (ddp_max_restarts=0). Elastic reports it as it reports any failed rank (the issue's
    `optim.lr=1e9` too): a ProcessExitedException traceback."""
    run_dir = tmp_path_factory.mktemp("killed-rank") / "run"
    launcher = start([*small(LONG, "log_every=1"), *DDP, "ddp_max_restarts=0"], run_dir)
    wait_for_epoch(launcher, run_dir)
    os.kill(launched_ranks(launcher.pid)[-1], signal.SIGKILL)
    return finish(launcher, run_dir)


def test_a_launcher_killed_with_sigkill_takes_its_ranks_along(tmp_path):
    """No handler runs on SIGKILL to the launcher alone; its ranks, forked from the trainer's
    server, end with it (the server sees its caller gone, and they their server) instead of
    training on."""
    run_dir = tmp_path / "run"
    launcher = start([*small(LONG), *DDP], run_dir)
    wait_for_epoch(launcher, run_dir)
    ranks = launched_ranks(launcher.pid)
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    assert len(ranks) == 2 and all_end(ranks), f"ranks {ranks} still run after their launcher was killed"


@pytest.fixture(scope="module")
def stopped_ddp_run(tmp_path_factory) -> Outcome:
    """Minor: SIGTERM to a DDP run in epochs of 16 steps with log_every far beyond them."""
    run_dir = tmp_path_factory.mktemp("stopped-ddp") / "run"
    launcher = start([*small(LONG, "data.train_size=1024", "log_every=1000"), *DDP], run_dir)
    wait_for_epoch(launcher, run_dir)
    launcher.send_signal(signal.SIGTERM)
    return finish(launcher, run_dir)


# ---------------------------------------------------------------------------- what else must hold


def reads_spanned_the_saves(outcome: Outcome) -> None:
    assert len(set(outcome.facts["steps_read"])) >= 2, outcome.facts  # reads saw several saves


def live_run_untouched(outcome: Outcome) -> None:
    assert outcome.facts["hydra_untouched"]  # its .hydra/ config is the live run's, not the refused one's
    writers = {path.name.split(".")[-2] for path in (outcome.run_dir / "tb").glob("events.*")}
    assert writers == {str(outcome.facts["owner"])}  # events.out.tfevents.<time>.<host>.<pid>.<n>
    assert "in use" not in (outcome.run_dir / "__main__.log").read_text()  # nor its log


def stale_lock_taken_over(outcome: Outcome) -> None:
    takeover = (
        f"was left locked by pid {outcome.facts['stale']} on host {outcome.facts['host']}, which has ended"
    )
    assert takeover in outcome.stderr
    assert json.loads((outcome.run_dir / METRICS).read_text())["overrides"][-2:] == [LONG, "seed=1"]
    assert not (outcome.run_dir / "run.lock").exists()  # let go when the run ended


def previous_file_intact(name: str) -> Callable[[Outcome], None]:
    def check(outcome: Outcome) -> None:
        assert (outcome.run_dir / name).read_text() == outcome.facts["previous"]

    return check


def rank_zero_history_kept(outcome: Outcome) -> None:
    metrics = json.loads((outcome.run_dir / METRICS).read_text())
    saved = torch.load(outcome.run_dir / CHECKPOINT, weights_only=False)
    assert metrics["epochs"] == len(metrics["history"]) >= 1
    assert metrics["steps"] == saved["step"] >= 4  # the last epoch's record, as last.pt holds it


def one_line_and_the_traceback_in_the_rank_log(outcome: Outcome) -> None:
    assert len(lines(outcome.stderr)) == 1  # the error; elastic's report went to the rank's file
    assert "ProcessExitedException: process 1 terminated" in (outcome.run_dir / "rank1.log").read_text()
    assert not (outcome.run_dir / "run.lock").exists()


def stopped_within_two_steps(outcome: Outcome) -> None:
    stop = re.search(r"stopped by SIGTERM at step (\d+) \(asked at step (\d+)\)", outcome.stderr)
    assert stop, outcome.stderr
    stopped, asked = map(int, stop.groups())
    assert 0 <= stopped - asked <= 2  # log_every=1000 and 16 steps an epoch: not at either


def progress_on_stdout(outcome: Outcome) -> None:
    assert "epoch 1/1000" in outcome.stdout and "peak lr" in outcome.stdout
    assert "[INFO]" not in outcome.stderr  # warnings and errors only, as in a single run


ROWS = {
    "R8-reader-beside-saves": Row(
        "reads_beside_saves",
        0,
        metrics={"status": "completed", "epochs": SAVES},
        check=reads_spanned_the_saves,
    ),
    "R7-second-run-into-live-folder": Row(
        "live_folder:second",
        1,
        ("trainer: error: run folder {run} is in use by pid {owner} on host {host}", "hydra.run.dir="),
        check=live_run_untouched,
    ),
    "R7-resume-into-live-folder": Row(
        "live_folder:resume",
        1,
        ("trainer: error: run folder {run} is in use by pid {owner} on host {host}",),
        check=live_run_untouched,
    ),
    "R7-python-trainer-into-live-folder": Row(
        "live_folder:python", None, ("run folder {run} is in use by pid {owner} on host {host}",)
    ),
    "R7-stale-lock-taken-over": Row(
        "live_folder:live", 130, metrics={"status": "interrupted"}, check=stale_lock_taken_over
    ),
    "R6-metrics-json-full-disk": Row(
        "metrics_on_a_full_disk",
        None,
        (
            "could not write the run record {run}/metrics.json (File too large)",
            "earlier metrics.json there is kept",
        ),
        check=previous_file_intact(METRICS),
    ),
    "R6-final-status-on-a-nearly-full-disk": Row(
        "final_record_on_a_nearly_full_disk",
        None,
        ("could not write the run record {run}/metrics.json (File too large)",),
        metrics={"status": "failed", "epochs": 2},  # the second epoch, saved before its record failed
    ),
    "R6-evaluation-json-full-disk": Row(
        "evaluation_on_a_full_disk",
        1,
        (
            "evaluate: error: could not write the evaluation {run}/evaluation.json (File too large)",
            "ulimit -f",
        ),
        check=previous_file_intact("evaluation.json"),
    ),
    "R2-rank-killed-after-epoch-1": Row(
        "killed_rank",
        1,
        ("[ERROR] - rank 1 failed: Signal 9 (SIGKILL)",),
        metrics={"status": "failed", "failed_rank": 1},
        check=rank_zero_history_kept,
    ),
    "R1-failing-rank-one-line": Row(
        "killed_rank",
        1,
        ("[ERROR] - rank 1 failed: Signal 9 (SIGKILL)",),
        check=one_line_and_the_traceback_in_the_rank_log,
    ),
    "minor-ddp-sigterm-within-two-steps": Row(
        "stopped_ddp_run", 130, metrics={"status": "interrupted"}, check=stopped_within_two_steps
    ),
    "minor-ddp-rank0-progress-on-stdout": Row("killed_rank", 1, check=progress_on_stdout),
    "R12-stdout-into-head": Row(
        "closed_console:head",
        0,
        ("trainer: <stdout> cannot be written (BrokenPipeError): the run goes on",),
        metrics={"status": "completed"},
        check=one_line_about_the_console,
    ),
    "R12-stdout-on-a-full-device": Row(
        "closed_console:full",
        0,
        ("trainer: <stdout> cannot be written (OSError): the run goes on",),
        metrics={"status": "completed"},
        check=one_line_about_the_console,
    ),
}


@pytest.mark.parametrize("row", ROWS.values(), ids=ROWS.keys())
def test_fault(row: Row, request):
    fixture, _, key = row.probe.partition(":")
    outcome = request.getfixturevalue(fixture)
    outcome = outcome[key] if key else outcome
    output = outcome.stdout + outcome.stderr

    assert outcome.returncode == row.exit_code, output[-3000:]
    assert "Traceback" not in output
    if row.error:
        last = lines(outcome.stderr)[-1]
        for fragment in row.error:
            assert fragment.format(run=outcome.run_dir, **outcome.facts) in last
    if row.metrics:
        metrics = json.loads((outcome.run_dir / METRICS).read_text())
        assert {key: metrics.get(key) for key in row.metrics} == row.metrics
    assert list(outcome.run_dir.rglob("*.tmp")) == []
    if row.check:
        row.check(outcome)
