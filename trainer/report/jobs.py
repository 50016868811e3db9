"""Reading a sweep: every folder holding .hydra/ is a job; its overrides and metrics.json.

Owns: finding job folders, parsing `.hydra/overrides.yaml` and `metrics.json` into `Job`s, the
numbers a job contributes (images/s, accuracy, ... and time to a target accuracy). Must not
touch: grouping, comparisons, formatting or plotting; it never writes a file, and a job that
failed or left nothing behind is a `Job` with that status, never an exception.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from trainer.job_names import job_place, sweep_jobs
from trainer.trials import includes_warm_up

BOOLEANS = ("false", "true")
NO_METRICS = "no metrics.json"
UNREADABLE = "unreadable metrics.json"
# read from metrics.json
JOB_NUMBERS = (
    *("img_per_s", "test_acc", "peak_mem_mb", "data_wait_frac"),
    *("startup_s", "setup_s", "compile_s", "wall_s"),  # where the job's wall clock went
)


class ReportError(Exception):
    """A problem with the command line or the folders: printed as one line, exit code 1."""


@dataclass
class Job:
    folder: Path
    name: str  # folder path relative to what all jobs share, e.g. "3"
    overrides: dict[str, str]  # key -> value, booleans lower-cased
    metrics: dict  # metrics.json; empty when absent
    status: str
    numbers: dict[str, float] = field(default_factory=dict)  # only for completed jobs
    includes_warm_up: bool = False  # its img_per_s times its first epoch (trainer.trials has the rule)


SWEEP_JOB = re.compile(r"^(\d+)_.*")  # <number>_<swept overrides> (trainer/job_names.py)


def short_name(folder_name: str) -> str:
    """A sweep job's number ('3' of '3_amp=true,channels_last=true'); other names as they are."""
    return SWEEP_JOB.sub(r"\1", folder_name)


def natural_key(path: Path) -> list:
    """'…/10' after '…/9'."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def jobs_under(folder: Path) -> list[Path]:
    """The runs under `folder` (folders holding .hydra/) and the jobs of the sweeps under it,
    which the default layout puts beside the single runs instead (trainer/job_names.py), in job
    order."""
    found = {hydra.parent for hydra in folder.rglob(".hydra") if hydra.is_dir()}
    found.update(job for sweep in folder.rglob("multirun.yaml") for job in sweep_jobs(sweep.parent))
    return sorted(found, key=lambda job: natural_key(job_place(job)))


def find_job_folders(folders: list[Path]) -> list[Path]:
    jobs = []
    for folder in folders:
        if not folder.is_dir():
            raise ReportError(f"no such folder: {folder}")
        found = jobs_under(folder)
        if not found:
            raise ReportError(f"no job folders (folders holding .hydra/) under {folder}")
        jobs.extend(found)
    return jobs


def parse_override(text: str) -> tuple[str, str]:
    """'amp=True' -> ('amp', 'true'): a sweep writes booleans as Python spells them."""
    key, _, value = text.partition("=")
    return key.lstrip("+~"), value.lower() if value.lower() in BOOLEANS else value


def read_overrides(folder: Path) -> dict[str, str]:
    path = folder / ".hydra" / "overrides.yaml"
    lines = yaml.safe_load(path.read_text()) if path.is_file() else None
    return dict(parse_override(str(line)) for line in lines or [])


def read_metrics(folder: Path) -> tuple[dict, str]:
    path = folder / "metrics.json"
    if not path.is_file():
        return {}, NO_METRICS
    try:
        metrics = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}, UNREADABLE
    problem = shape_problem(metrics)
    if problem is not None:
        return {"error": problem}, "malformed metrics.json"
    return metrics, str(metrics.get("status", "unknown"))


# The figures the report computes with, in metrics.json and in each epoch of its history.
NUMBERS = (
    *JOB_NUMBERS,
    *("time_to_target_s", "target_acc", "best_test_acc", "test_acc_tta", "mfu", "jobs_at_once"),
)
HISTORY_NUMBERS = ("test_acc", "test_acc_tta", "train_time_s", "eval_s", "wall_s", "img_per_s", "epoch_s")


def shape_problem(metrics: object) -> str | None:
    """What makes a metrics.json unusable for the report (one phrase), or None."""
    if not isinstance(metrics, dict):
        return f"metrics.json holds a {type(metrics).__name__}, not an object"
    wrong = [key for key in NUMBERS if not is_number_or_null(metrics.get(key))]
    if wrong:
        return f"metrics.json's {wrong[0]} is {metrics[wrong[0]]!r}, not a number"
    history = metrics.get("history", [])
    if not isinstance(history, list) or not all(isinstance(entry, dict) for entry in history):
        return "metrics.json's history is not a list of objects"
    for index, entry in enumerate(history):
        wrong = [key for key in HISTORY_NUMBERS if not is_number_or_null(entry.get(key))]
        if wrong:
            return f"metrics.json's history[{index}].{wrong[0]} is {entry[wrong[0]]!r}, not a number"
    return None


def is_number_or_null(value: object) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def time_to_target(history: list[dict], target: float) -> float | None:
    """Seconds until the first evaluation whose test accuracy (with TTA where the run had it)
    reached target: training plus evaluation time, as the trainer counts time_to_target_s
    (wall-clock time since the start for runs that did not record evaluation times)."""
    evaluating = 0.0
    for entry in history:
        evaluating += entry.get("eval_s", 0.0)
        accuracy = entry.get("test_acc_tta", entry.get("test_acc"))
        if accuracy is not None and accuracy >= target:
            return entry["train_time_s"] + evaluating if "eval_s" in entry else entry["wall_s"]
    return None


def job_time_to_target(metrics: dict, target: float | None) -> float | None:
    """The run's own time_to_target_s when it was trained for this target, else from its history."""
    recorded = metrics.get("target_acc")
    if recorded is not None and (target is None or math.isclose(recorded, target)):
        return metrics.get("time_to_target_s")
    return None if target is None else time_to_target(metrics.get("history", []), target)


def recorded_target(jobs: list[Job]) -> float | None:
    """The target_acc the completed jobs were trained for, when they share one."""
    targets = {job.metrics.get("target_acc") for job in jobs if job.status == "completed"}
    return targets.pop() if len(targets) == 1 else None


def job_names(folders: list[Path]) -> list[str]:
    """Each job folder relative to the folder all of them share, a sweep job by its number
    (its folder '3_amp=true,channels_last=true' holds the overrides, which have columns of
    their own): '3', or 'sweep-b/3'."""
    places = [job_place(folder.resolve()) for folder in folders]  # a job as if in its sweep folder
    if len(places) == 1:
        names = [Path(places[0].name)]
    else:
        shared = Path(os.path.commonpath(places))
        names = [place.relative_to(shared) for place in places]
    return [str(name.with_name(short_name(name.name))) for name in names]


def load_jobs(folders: list[Path], target_acc: float | None) -> list[Job]:
    job_folders = find_job_folders(folders)
    jobs = []
    for folder, name in zip(job_folders, job_names(job_folders)):
        metrics, status = read_metrics(folder)
        job = Job(folder, name, read_overrides(folder), metrics, status)
        if status == "completed":
            job.numbers = {key: metrics.get(key) for key in JOB_NUMBERS}
            job.numbers["time_to_target_s"] = job_time_to_target(metrics, target_acc)
            job.includes_warm_up = includes_warm_up(metrics)
        jobs.append(job)
    return jobs
