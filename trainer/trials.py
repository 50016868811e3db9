"""Trials: each a training run in its own process, timed without its warm-up, repeated, summarized.

A trial is one `python -m trainer ...` process (or any command that leaves a trainer-style
metrics.json in its run folder), so that no trial inherits another's compiled graphs, cuDNN plans
or allocator state. Its images/s leaves out the first epoch (loader start, first allocations,
autotuning, the process's start-up); repeats give a median and a min-max spread; results can be
appended as JSON lines as they come, so a stopped series keeps what finished.

Owns: the warm-up rule (`timed_epochs`, `includes_warm_up`; the sweep report reads it too), starting a trial
and reading back what it left (`run_trial`, `fresh_trial`, `trial_left`; trainer.trial_fork forks one
instead), repeating them (`repeat` back to back, `rounds` interleaved), the numbers of one trial
(`steady_numbers`) and of its repeats (`median_and_spread`), and the cells every trial table shares (`fmt`,
`spread`, `environment`, `machine`). Must not touch: what to run (row lists, peers and their tables live in
scripts/, the choice of settings in the tuner) or the training itself; torch is imported only by
`gpu_name()` and its callers, so the report can use this module without it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from trainer import process_tree

METRICS = "metrics.json"
TIMED_OUT = "timed out"  # how a trial stopped at its time limit is reported


def timed_epochs(history: list[dict]) -> list[dict]:
    """The epochs whose speed counts: all after the first, or the only one there is."""
    return history[1:] or history


def includes_warm_up(metrics: dict) -> bool:
    """Whether a run's images/s includes its warm-up: the trainer leaves the first epoch out of
    img_per_s only when there are two or more. A one-epoch run times its loader start, first
    allocations and autotuning, and a sweep's first job also the process's own start-up (CUDA
    context, first kernels), which the later jobs of the sweep find done."""
    return len(metrics.get("history", [])) < 2


def trainer_command(overrides: list[str], run_dir: Path) -> list[str]:
    """`python -m trainer OVERRIDES` writing into run_dir."""
    return [sys.executable, "-m", "trainer", *overrides, f"hydra.run.dir={run_dir}"]


def fresh_trial(overrides: list[str], run_dir: Path, timeout_s: float | None = None) -> Trial:
    """`python -m trainer OVERRIDES` in a new interpreter, writing into run_dir."""
    return run_trial(trainer_command(overrides, run_dir), run_dir, timeout_s)


@dataclass
class Trial:
    """What one process left: its metrics.json ({} when none), exit code and output."""

    run_dir: Path
    metrics: dict
    returncode: int | None  # None: stopped at the time limit
    stdout: str
    stderr: str
    process_s: float  # start to exit, seen from outside
    timeout_s: float | None = None

    @property
    def failure(self) -> str | None:
        """Why the trial has no numbers (one line), or None."""
        if self.returncode is None:
            return f"{TIMED_OUT} after {self.timeout_s:.0f} s"
        if self.returncode != 0 or not self.metrics:
            tail = (self.stderr or self.stdout).strip().splitlines()[-1:] or ["?"]
            return f"failed: {tail[0][:120]}"
        return None


def run_trial(
    command: list[str],
    run_dir: Path,
    timeout_s: float | None = None,
    cwd: Path | None = None,
    env: dict | None = None,
) -> Trial:
    """Run one trial process, a fresh one even beside python -m trainer.serve (TRAINER_SERVE=0);
    its output is kept in run_dir/output.log (up to the time limit, when it hits it). The trial
    dies with this process (die_with_parent). The trial gets a process group of its own, and a
    trial stopped at the limit or by the caller's interrupt takes every process in it along (DDP
    ranks and loader workers are its children: left running, they would hold the next trial's GPUs)."""
    started = time.perf_counter()
    env = {**(os.environ if env is None else env), "TRAINER_SERVE": "0"}
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, preexec_fn=die_with_parent,
    )  # fmt: skip
    returncode: int | None
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
        returncode = process.returncode
    except subprocess.TimeoutExpired:
        kill_tree(process.pid)  # it leads its group: start_new_session
        stdout, stderr = process.communicate()
        returncode = None
    except BaseException:
        kill_tree(process.pid)  # it leads its group: start_new_session
        raise
    return trial_left(run_dir, returncode, stdout, stderr, time.perf_counter() - started, timeout_s)


def trial_left(
    run_dir: Path, returncode: int | None, stdout: str, stderr: str, process_s: float, timeout_s: float | None
) -> Trial:
    """What a trial process left: its output kept in run_dir/output.log, its metrics.json read
    (none when it was stopped at its limit)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "output.log").write_text(stdout + stderr)
    metrics_file = run_dir / METRICS
    finished = returncode is not None and metrics_file.is_file()
    metrics = json.loads(metrics_file.read_text()) if finished else {}
    return Trial(run_dir, metrics, returncode, stdout, stderr, process_s, timeout_s)


PR_SET_PDEATHSIG = 1  # linux/prctl.h
# looked up here, not in a forked child before exec (preexec_fn), where loading it could deadlock
PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def die_with_parent() -> None:
    """SIGKILL to this process when its parent dies, however (kill -9 included); Linux only. A
    trial outliving its tuner ran on for 70-78 s and wrote into the tune folder. A parent gone
    already (before this call) ends this process at once."""
    if PRCTL is None:
        return
    parent = os.getppid()
    PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def kill_tree(leader: int) -> None:
    """SIGKILL to the process group `leader` leads and to every process under it: DataLoader
    workers leave for process groups of their own (trainer.perf.inputs), out of the group's
    reach, and would otherwise run on for seconds into the next trial. The tree is read before
    anything is killed: a killed parent's children are handed to init and no longer under it."""
    below = process_tree.descendants(leader)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(leader, signal.SIGKILL)
    process_tree.kill(below)


def steady_numbers(trial: Trial) -> dict:
    """A trial's images/s (the median over its timed epochs), peak memory, data wait and test
    accuracy; or only its status when it failed."""
    if trial.failure:
        return {"status": trial.failure}
    timed = timed_epochs(trial.metrics["history"])
    waits = [r["data_wait_frac"] for r in timed if r.get("data_wait_frac") is not None]
    return {
        "status": trial.metrics["status"],
        "img_per_s": statistics.median(r["img_per_s"] for r in timed),
        "peak_mem_mb": trial.metrics.get("peak_mem_mb"),
        "data_wait_frac": statistics.median(waits) if waits else None,
        "test_acc": trial.metrics.get("test_acc"),
    }


def repeat(run: Callable[[int], dict], repeats: int, label: str) -> list[dict]:
    """run(0), ..., run(repeats - 1), each trial's images/s printed as a line as it ends. A trial
    that timed out ends the series: a hang repeats, and each would cost the whole time limit."""
    return rounds({label: run}, repeats)[label]


def rounds(
    runs: dict[str, Callable[[int], dict]],
    repeats: int,
    after_round: Callable[[dict[str, list[dict]]], None] | None = None,
) -> dict[str, list[dict]]:
    """Run 1 of every setting, then run 2 of every setting, and so on (with one setting, its
    repeats back to back); each trial's images/s printed as a line as it ends, after_round
    called with every setting's runs so far. Interleaved, a drift of the host (clocks, heat,
    neighbours) falls on every setting alike, where back-to-back repeats hand it to whichever
    ran last. A setting whose trial timed out runs no more: a hang repeats, and each would
    cost the whole time limit."""
    results: dict[str, list[dict]] = {label: [] for label in runs}
    for index in range(repeats):
        for label, run in runs.items():
            done = results[label]
            if done and done[-1]["status"].startswith(TIMED_OUT):
                continue
            started = time.perf_counter()
            done.append(run(index))
            print(
                f"  {label} | run {index + 1}: {fmt(done[-1].get('img_per_s'), ',.0f')} img/s "
                f"({done[-1]['status']}, {time.perf_counter() - started:.0f} s)",
                flush=True,
            )
            if done[-1]["status"].startswith(TIMED_OUT) and index + 1 < repeats:
                skipped = repeats - index - 1
                print(f"  {label} | the other {skipped} run(s) skipped: run {index + 1} timed out")
        if after_round is not None:
            after_round(results)
    return results


def median_and_spread(runs: list[dict]) -> dict:
    """The repeats of one setting: how many gave numbers, the median images/s and its min-max
    spread, the median peak memory and data wait; a status that counts the failures."""
    done = [run for run in runs if "img_per_s" in run]
    if not done:
        return {"runs": 0, "status": runs[-1]["status"]}
    rates = [run["img_per_s"] for run in done]
    waits = [run["data_wait_frac"] for run in done if run["data_wait_frac"] is not None]
    return {
        "runs": len(done),
        "status": "completed" if len(done) == len(runs) else f"{len(runs) - len(done)} run(s) failed",
        "img_per_s": statistics.median(rates),
        "min_img_per_s": min(rates),
        "max_img_per_s": max(rates),
        "peak_mem_mb": statistics.median(run["peak_mem_mb"] or 0 for run in done) or None,
        "data_wait_frac": statistics.median(waits) if waits else None,
    }


def median_of(runs: list[dict], key: str) -> float | None:
    values = [run[key] for run in runs if run.get(key) is not None]
    return statistics.median(values) if values else None


def append_jsonl(path: Path, record: dict) -> None:
    """One line per result, flushed at once: a series cut short keeps every finished trial."""
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")


def fmt(value, spec: str) -> str:
    return "" if value is None or value == "" else format(value, spec)


def spread(result: dict) -> str:
    """'140,000-150,000' for a row of several runs with numbers, else ''."""
    if not result.get("img_per_s") or int(result["runs"]) <= 1:
        return ""
    return f"{result['min_img_per_s']:,.0f}-{result['max_img_per_s']:,.0f}"


def gpu_name(with_uuid: bool = False) -> str:
    """This process's GPU ('no GPU' without CUDA); with_uuid adds the card's own UUID."""
    import torch

    if not torch.cuda.is_available():
        return "no GPU"
    if not with_uuid:
        return torch.cuda.get_device_name()
    uuid = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", "")
    return f"{torch.cuda.get_device_name()} {uuid}".strip()


def environment() -> str:
    """The GPU, torch version and date, for a table's header."""
    import torch

    return f"{gpu_name()}, torch {torch.__version__}, {datetime.now():%Y-%m-%d}"


def machine() -> str:
    """This host, its GPU and torch: trials compare only with trials of the same machine (two
    hosts of one GPU kind have differed by up to 1.5x on the same run). The GPU is named by its
    UUID too: cloud machines of one kind often share a host name."""
    import torch

    return f"{platform.node()}, {gpu_name(with_uuid=True)}, torch {torch.__version__}"
