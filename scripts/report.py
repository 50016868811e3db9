"""Sweep report: one table, two charts and a one-toggle-at-a-time summary for trainer runs.

    python scripts/report.py outputs/multirun/2026-11-21/05-59-16.850987
    python scripts/report.py SWEEP [MORE_FOLDERS ...] [--out DIR] [--target-acc 0.94]
                             [--baseline amp=false,channels_last=false | --baseline 0]

Every folder holding .hydra/ below the given folders is a job: its .hydra/overrides.yaml and
metrics.json are read. report.md, report.csv, speedup.png and accuracy_vs_time.png go into the
first folder (or --out) and report.md is printed. Jobs that differ only in `seed` share one row
(mean ± std over their completed runs). A job that failed, was interrupted, is still running or
left no metrics.json is listed with its status and no numbers; it never stops the report.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import os
import re
import statistics
import sys
import textwrap
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import PercentFormatter

GROUPED_KEY = "seed"  # jobs differing only in this key are repeats of one setting
BOOLEANS = ("false", "true")
NO_METRICS = "no metrics.json"
# read from metrics.json
JOB_NUMBERS = ("img_per_s", "test_acc", "peak_mem_mb", "data_wait_frac", "compile_s", "wall_s")


def percent(value: float) -> str:
    return f"{value:.2%}"


def show_speedup(value: float) -> str:
    return f"{value:.2f}×"


def show_change(value: float) -> str:
    return f"{100 * value:+.2f} pp"


@dataclass(frozen=True)
class Column:
    key: str  # a number per job; also the csv column (its std in `<key>_std`)
    header: str  # in report.md
    show: Callable[[float], str]  # a value in report.md
    show_std: Callable[[float], str] | None = None  # its std, where a std means something


COLUMNS = (
    Column("img_per_s", "img/s", "{:,.0f}".format, "{:,.0f}".format),
    Column("speedup", "speed-up", show_speedup, "{:.2f}".format),
    Column("test_acc", "test acc", percent, percent),
    Column("test_acc_change", "Δ acc vs baseline", show_change),
    Column("peak_mem_mb", "peak mem MB", "{:,.0f}".format, "{:,.0f}".format),
    Column("data_wait_frac", "data wait", "{:.1%}".format, "{:.1%}".format),
    Column("compile_s", "compile", "{:.1f} s".format, "{:.1f}".format),  # warm-up before the clock
    Column("wall_s", "wall", "{:.1f} s".format, "{:.1f}".format),  # process start to exit
    Column("time_to_target_s", "time to target", "{:.1f} s".format, "{:.1f}".format),  # the last column
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


@dataclass
class Row:
    jobs: list[Job]
    settings: dict[str, str]  # the overrides that differ between rows
    is_baseline: bool = False

    @property
    def name(self) -> str:
        return ",".join(job.name for job in self.jobs)

    @property
    def label(self) -> str:
        return ", ".join(f"{key}={value}" for key, value in self.settings.items()) or self.name

    @property
    def status(self) -> str:
        counts = Counter(job.status for job in self.jobs)
        if len(counts) == 1:
            return self.jobs[0].status
        return ", ".join(f"{count} {status}" for status, count in counts.items())

    def values(self, key: str) -> list[float]:
        return [job.numbers[key] for job in self.jobs if job.numbers.get(key) is not None]

    def mean(self, key: str) -> float | None:
        values = self.values(key)
        return statistics.fmean(values) if values else None

    def std(self, key: str) -> float | None:
        values = self.values(key)
        return statistics.stdev(values) if len(values) > 1 else None


# ---------------------------------------------------------------------------- reading jobs


def natural_key(path: Path) -> list:
    """'…/10' after '…/9'."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def find_job_folders(folders: list[Path]) -> list[Path]:
    jobs = []
    for folder in folders:
        if not folder.is_dir():
            raise ReportError(f"no such folder: {folder}")
        found = sorted({hydra.parent for hydra in folder.rglob(".hydra") if hydra.is_dir()}, key=natural_key)
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
        return {}, "unreadable metrics.json"
    return metrics, str(metrics.get("status", "unknown"))


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
    """Each job folder relative to the folder all of them share: '3', or 'sweep-b/3'."""
    if len(folders) == 1:
        return [folders[0].name]
    shared = Path(os.path.commonpath([folder.resolve() for folder in folders]))
    return [str(folder.resolve().relative_to(shared)) for folder in folders]


def load_jobs(folders: list[Path], target_acc: float | None) -> list[Job]:
    job_folders = find_job_folders(folders)
    jobs = []
    for folder, name in zip(job_folders, job_names(job_folders)):
        metrics, status = read_metrics(folder)
        job = Job(folder, name, read_overrides(folder), metrics, status)
        if status == "completed":
            job.numbers = {key: metrics.get(key) for key in JOB_NUMBERS}
            job.numbers["time_to_target_s"] = job_time_to_target(metrics, target_acc)
        jobs.append(job)
    return jobs


# ---------------------------------------------------------------------------- rows and baseline


def differing_keys(jobs: list[Job]) -> list[str]:
    """Override keys whose value is not the same in every job, in command-line order."""
    keys = list(dict.fromkeys(key for job in jobs for key in job.overrides))
    return [key for key in keys if len({job.overrides.get(key, "") for job in jobs}) > 1]


def group_rows(jobs: list[Job], keys: list[str]) -> list[Row]:
    setting_keys = [key for key in keys if key != GROUPED_KEY]
    rows: dict[tuple, Row] = {}
    for job in jobs:
        settings = {key: job.overrides.get(key, "default") for key in setting_keys}
        rows.setdefault(tuple(settings.items()), Row([], settings)).jobs.append(job)
    return list(rows.values())


def matches(row: Row, spec: str) -> bool:
    """spec: a job folder name ('0'), or overrides such as 'amp=false,channels_last=false'."""
    if "=" not in spec:
        return any(spec in (job.name, job.folder.name, str(job.folder)) for job in row.jobs)
    wanted = dict(parse_override(pair) for pair in spec.split(","))
    return any(all(job.overrides.get(key) == value for key, value in wanted.items()) for job in row.jobs)


def choose_baseline(rows: list[Row], spec: str | None) -> tuple[Row | None, str]:
    """The row to compare against, and why it was chosen."""
    measured = [row for row in rows if row.mean("img_per_s")]
    if spec:
        chosen = [row for row in rows if matches(row, spec)]
        if len(chosen) != 1:
            names = "; ".join(f"{row.name}: {row.label}" for row in rows)
            raise ReportError(f"--baseline {spec} matches {len(chosen)} rows, not 1 (rows: {names})")
        if chosen[0] not in measured:
            raise ReportError(
                f"--baseline {spec} is job {chosen[0].name}, which has no images/s "
                f"({chosen[0].status}): choose another with --baseline"
            )
        return chosen[0], f"--baseline {spec}"
    toggles = [key for key in rows[0].settings if all(row.settings[key] in BOOLEANS for row in rows)]
    all_off = [row for row in measured if toggles and all(row.settings[k] == "false" for k in toggles)]
    if len(all_off) == 1:
        return all_off[0], "every toggle off"
    if all_off:
        return min(all_off, key=lambda row: row.mean("img_per_s")), "the slowest with every toggle off"
    if measured:
        return min(measured, key=lambda row: row.mean("img_per_s")), "the slowest that completed"
    return None, "no baseline: no job completed"


def add_comparisons(rows: list[Row], baseline: Row | None) -> None:
    if baseline is None:
        return
    baseline.is_baseline = True
    base_speed, base_acc = baseline.mean("img_per_s"), baseline.mean("test_acc")
    for row in rows:
        for job in row.jobs:
            if job.numbers.get("img_per_s") is not None:
                job.numbers["speedup"] = job.numbers["img_per_s"] / base_speed
            if job.numbers.get("test_acc") is not None and base_acc is not None:
                job.numbers["test_acc_change"] = job.numbers["test_acc"] - base_acc


# ---------------------------------------------------------------------------- one toggle at a time


def factor_levels(rows: list[Row], baseline: Row | None) -> dict[str, tuple[str, str]] | None:
    """(off, on) for every swept key when each takes exactly two values: false -> true for
    booleans, else the baseline's value -> the other one. None when any key has more."""
    levels = {}
    for key in rows[0].settings:
        values = sorted({row.settings[key] for row in rows})
        if len(values) != 2:
            return None
        if tuple(values) == BOOLEANS:
            levels[key] = BOOLEANS
        else:
            off = baseline.settings[key] if baseline is not None else values[0]
            levels[key] = (off, values[1] if values[0] == off else values[0])
    return levels


def toggle_effects(
    rows: list[Row], baseline: Row | None
) -> list[tuple[str, float | None, float | None, int]] | None:
    """For a full factorial over two-level settings (booleans, or any key swept over two
    values): per key, the geometric-mean speed-up ratio and the mean accuracy change of
    switching it from its off level to its on level, over the other keys' settings, and
    how many on/off pairs had numbers. None when the rows are not such a factorial."""
    levels = factor_levels(rows, baseline) if rows and rows[0].settings else None
    if not levels:
        return None
    keys = list(levels)
    settings = {tuple(row.settings[key] for key in keys): row for row in rows}
    complete = list(itertools.product(*(levels[key] for key in keys)))
    if len(rows) != len(complete) or set(settings) != set(complete):
        return None
    effects = []
    for index, key in enumerate(keys):
        off_level, on_level = levels[key]
        ratios, changes = [], []
        for off_key in (combo for combo in complete if combo[index] == off_level):
            off, on = settings[off_key], settings[(*off_key[:index], on_level, *off_key[index + 1 :])]
            if on.mean("img_per_s") and off.mean("img_per_s"):
                ratios.append(on.mean("img_per_s") / off.mean("img_per_s"))
            if on.mean("test_acc") is not None and off.mean("test_acc") is not None:
                changes.append(on.mean("test_acc") - off.mean("test_acc"))
        speedup = statistics.geometric_mean(ratios) if ratios else None
        label = key if (off_level, on_level) == BOOLEANS else f"{key}: {off_level} → {on_level}"
        effects.append((label, speedup, statistics.fmean(changes) if changes else None, len(ratios)))
    return effects


# ---------------------------------------------------------------------------- writing


def columns(target_acc: float | None) -> tuple:
    return COLUMNS if target_acc is not None else COLUMNS[:-1]


def cell(value: float | None, show: Callable[[float], str]) -> str:
    return "" if value is None else show(value)


def markdown_table(rows: list[Row], target_acc: float | None) -> list[str]:
    shown = columns(target_acc)
    headers = ["job", *rows[0].settings, "n", *(column.header for column in shown), "status"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        numbers = []
        for column in shown:
            text, std = cell(row.mean(column.key), column.show), row.std(column.key)
            if std is not None and column.show_std:
                text = f"{text} ± {column.show_std(std)}"
            numbers.append(text)
        name = f"{row.name} (baseline)" if row.is_baseline else row.name
        cells = [name, *row.settings.values(), str(len(row.values("img_per_s"))), *numbers, row.status]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown_report(title: str, rows: list[Row], baseline_note: str, effects, target_acc) -> str:
    jobs = [job for row in rows for job in row.jobs]
    grouped = f"; mean ± std over `{GROUPED_KEY}`" if len(jobs) > len(rows) else ""
    lines = [
        f"# Report: {title}",
        "",
        f"{len(jobs)} jobs in {len(rows)} rows; {baseline_note}.",
        f"Speed-up = images/s ÷ baseline images/s. n = completed jobs in the row{grouped}.",
    ]
    if target_acc is not None:
        reached = percent(target_acc)
        lines.append(
            f"Time to target: training + evaluation seconds until the test accuracy (with TTA where "
            f"used) first reached {reached}."
        )
    lines += ["", *markdown_table(rows, target_acc)]
    if effects:
        lines += [
            "",
            "## One toggle at a time",
            "",
            "Switching each toggle on, averaged over the other toggles' settings "
            "(speed-up: geometric mean of on/off images/s).",
            "",
            "| toggle | speed-up | Δ acc | pairs |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {toggle} | {cell(speedup, show_speedup)} | {cell(change, show_change)} | {pairs} |"
            for toggle, speedup, change, pairs in effects
        ]
    unfinished = [job for job in jobs if job.status != "completed"]
    if unfinished:
        lines += ["", "## Jobs that did not complete", ""]
        lines += [
            f"- {job.name} ({job.folder}): {job.status}"
            + (f": {job.metrics['error']}" if job.metrics.get("error") else "")
            for job in unfinished
        ]
    lines += ["", "![speed-up](speedup.png)", "", "![accuracy vs time](accuracy_vs_time.png)", ""]
    return "\n".join(lines)


def csv_numbers(row: Row, shown: tuple[Column, ...]) -> dict[str, float | str]:
    numbers = {}
    for column in shown:
        numbers[column.key] = row.mean(column.key)
        if column.show_std:
            numbers[f"{column.key}_std"] = row.std(column.key)
    return {key: "" if value is None else value for key, value in numbers.items()}


def write_csv(path: Path, rows: list[Row], target_acc: float | None) -> None:
    """Numbers unformatted: each the mean over the row's completed jobs, `<key>_std` their std."""
    records = []
    for row in rows:
        errors = [job.metrics["error"] for job in row.jobs if job.metrics.get("error")]
        records.append(
            {
                "job": row.name,
                **row.settings,
                "baseline": "yes" if row.is_baseline else "",
                "n": len(row.values("img_per_s")),
                "status": row.status,
                **csv_numbers(row, columns(target_acc)),
                "error": errors[0] if errors else "",
            }
        )
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)


def save(figure: Figure, path: Path) -> None:
    FigureCanvasAgg(figure)
    figure.savefig(path, dpi=100, bbox_inches="tight")  # "tight": grows to fit long labels


def bar_label(row: Row) -> str:
    repeats = f" (n={len(row.jobs)})" if len(row.jobs) > 1 else ""
    return textwrap.fill(row.label + repeats, width=50)


def plot_speedup(rows: list[Row], path: Path) -> None:
    labels = [bar_label(row) for row in rows]
    height = 1.2 + 0.3 * sum(label.count("\n") + 1.5 for label in labels)
    figure = Figure(figsize=(8, max(3.0, height)))
    axes = figure.add_subplot()
    positions = range(len(rows))[::-1]  # first row at the top
    speedups = [row.mean("speedup") or 0.0 for row in rows]
    errors = [row.std("speedup") or 0.0 for row in rows]
    colors = ["tab:gray" if row.is_baseline else "tab:blue" for row in rows]
    axes.barh(positions, speedups, color=colors)
    for position, row, speedup, error in zip(positions, rows, speedups, errors):
        if error:
            axes.errorbar(speedup, position, xerr=error, color="black", capsize=4)
        text = f"{speedup:.2f}×" if row.mean("speedup") else row.status
        axes.text(speedup + error, position, f"  {text}", va="center")
    axes.set_yticks(list(positions), labels)
    axes.axvline(1.0, color="black", linewidth=0.8, linestyle="--")
    axes.set_xlim(0, 1.25 * max([1.0] + [speedup + error for speedup, error in zip(speedups, errors)]))
    axes.set_xlabel("speed-up: images/s ÷ baseline images/s (gray: the baseline; bars: mean ± std)")
    axes.set_title("Training throughput")
    save(figure, path)


def plot_accuracy(jobs: list[Job], keys: list[str], target_acc: float | None, path: Path) -> None:
    figure = Figure(figsize=(9, 5.5))
    axes = figure.add_subplot()
    for job in jobs:
        points = [(e["wall_s"], e["test_acc"]) for e in job.metrics.get("history", []) if "test_acc" in e]
        if points:
            label = ", ".join(f"{key}={job.overrides.get(key, 'default')}" for key in keys) or job.name
            status = "" if job.status == "completed" else f" [{job.status}]"
            axes.plot(*zip(*points), marker="o", label=label + status)
    if target_acc is not None:
        axes.axhline(target_acc, color="black", linewidth=0.8, linestyle="--", label="target")
    if axes.has_data():
        axes.legend(fontsize="small", loc="best")
    else:
        axes.text(0.5, 0.5, "no evaluated epochs", ha="center", transform=axes.transAxes)
    axes.set_xlabel("wall-clock time since the start of training (s)")
    axes.set_ylabel("test accuracy")
    axes.yaxis.set_major_formatter(PercentFormatter(1.0))
    axes.set_title("Test accuracy against time")
    axes.grid(alpha=0.3)
    save(figure, path)


# ---------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="report.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folders", nargs="+", type=Path, help="run or sweep folders (searched recursively)")
    parser.add_argument("--out", type=Path, metavar="DIR", help="where to write (default: the first folder)")
    parser.add_argument(
        "--baseline",
        metavar="JOB",
        help="the job to compare against: its folder name (e.g. 3) or overrides (e.g. "
        "amp=false,compile=false); default: the one with every toggle off, else the slowest",
    )
    parser.add_argument(
        "--target-acc",
        type=float,
        metavar="ACC",
        help="add a column: seconds until the test accuracy first reached ACC (e.g. 0.94); default: "
        "the target_acc the runs were trained with, from their metrics.json",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        jobs = load_jobs(args.folders, args.target_acc)
        target_acc = args.target_acc if args.target_acc is not None else recorded_target(jobs)
        keys = differing_keys(jobs)
        rows = group_rows(jobs, keys)
        baseline, reason = choose_baseline(rows, args.baseline)
    except ReportError as error:
        print(f"report: error: {error}", file=sys.stderr)
        return 1
    add_comparisons(rows, baseline)
    note = f"baseline: job {baseline.name} ({baseline.label}), {reason}" if baseline else reason
    out = args.out or args.folders[0]
    out.mkdir(parents=True, exist_ok=True)
    title = ", ".join(map(str, args.folders))
    report = markdown_report(title, rows, note, toggle_effects(rows, baseline), target_acc)
    (out / "report.md").write_text(report)
    write_csv(out / "report.csv", rows, target_acc)
    plot_speedup(rows, out / "speedup.png")
    plot_accuracy(jobs, keys, target_acc, out / "accuracy_vs_time.png")
    print(report)
    print(f"wrote report.md, report.csv, speedup.png, accuracy_vs_time.png to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
