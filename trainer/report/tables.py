"""report.md and report.csv: the columns, how each number is shown, the text around them.

Owns: the column list (`COLUMNS`), the markdown report (table, toggle summary, unfinished jobs)
and the csv (numbers unformatted). Must not touch: which rows exist or what they are compared
against (rows.py, effects.py); it formats what it is given and writes only report.csv.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainer.report.rows import GROUPED_KEY, Row


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
    # where a job's wall time went besides training: the process (or, for a sweep's later job in
    # the same process, the job) before its set-up, the set-up, the warm-up's compile
    Column("startup_s", "start-up", "{:.1f} s".format, "{:.1f}".format),
    Column("setup_s", "set-up", "{:.1f} s".format, "{:.1f}".format),
    Column("compile_s", "compile", "{:.1f} s".format, "{:.1f}".format),  # warm-up before the clock
    Column("wall_s", "wall", "{:.1f} s".format, "{:.1f}".format),  # the run from its start to its end
    Column("time_to_target_s", "time to target", "{:.1f} s".format, "{:.1f}".format),  # the last column
)


def columns(target_acc: float | None) -> tuple:
    return COLUMNS if target_acc is not None else COLUMNS[:-1]


WARM_UP_MARK = " (with warm-up)"  # after an img/s that times a run's first epoch


def cell(value: float | None, show: Callable[[float], str]) -> str:
    return "" if value is None else show(value)


def which_jobs(names: list[str], timed: list) -> str:
    """The jobs a note is about: "every job" where they are all the timed ones, else by name."""
    return "every job" if len(names) == len(timed) else f"job {', '.join(names)}"


def warm_up_note(rows: list[Row]) -> list[str]:
    """One line naming the jobs whose images/s includes warm-up, when there are any."""
    timed = [job for row in rows for job in row.jobs if job.numbers.get("img_per_s")]
    marked = [job.name for job in timed if job.includes_warm_up]
    if not marked:
        return []
    return [
        f"img/s{WARM_UP_MARK}: {which_jobs(marked, timed)} timed only one epoch, warm-up included (a sweep's "
        "first job also pays the process's start-up), so no speed-up is given; run with epochs>=2 "
        "and img/s leaves the first epoch out."
    ]


def side_by_side_note(rows: list[Row]) -> list[str]:
    """One line when jobs ran beside each other on one CPU (hydra/launcher=parallel): they
    shared its cores, so each one's images/s is below what it would do alone. On GPUs, each
    job holds a GPU of its own (README, "Sweeps on every GPU": as fast beside another as alone)."""
    timed = [job for row in rows for job in row.jobs if job.numbers.get("img_per_s")]
    shared = [
        job
        for job in timed
        if (job.metrics.get("jobs_at_once") or 1) > 1 and str(job.metrics.get("device")).startswith("cpu")
    ]
    if not shared:
        return []
    at_once = max(job.metrics["jobs_at_once"] for job in shared)
    which = which_jobs([job.name for job in shared], timed)
    return [
        f"img/s: {which} ran {at_once} at a time on this host's CPU (hydra/launcher=parallel), "
        "sharing its cores, so each ran slower than it would alone (on 2 cores 892 against 1,441 "
        'img/s: README, "Sweeps on every GPU"); for images/s that compare, sweep under the basic '
        "launcher (without hydra/launcher=parallel)."
    ]


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
            if column.key == "img_per_s" and text and row.includes_warm_up:
                text += WARM_UP_MARK
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
    lines += warm_up_note(rows) + side_by_side_note(rows)
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
                "img_per_s_includes_warm_up": "yes" if row.includes_warm_up else "",
                "error": errors[0] if errors else "",
            }
        )
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
