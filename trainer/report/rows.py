"""Rows of the report: jobs that differ only in `seed` share one; the baseline; comparisons.

Owns: which overrides make a row (`differing_keys`, `group_rows`), a row's mean and std, the
choice of the baseline row (`--baseline` or the rule in `choose_baseline`) and each job's
speed-up and accuracy change against it. A row whose images/s includes warm-up (trainer.trials,
`includes_warm_up`) gets no speed-up and is no baseline while a row without warm-up can be.
Must not touch: reading folders (jobs.py), formatting (tables.py), plotting (plots.py);
nothing here writes a file or prints.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass

from trainer.job_names import job_place
from trainer.report.jobs import BOOLEANS, Job, ReportError, parse_override, short_name

GROUPED_KEY = "seed"  # jobs differing only in this key are repeats of one setting


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

    @property
    def includes_warm_up(self) -> bool:
        return any(job.includes_warm_up for job in self.jobs if job.numbers.get("img_per_s") is not None)

    def speed(self) -> float | None:
        """Mean images/s where it can be compared: None when a job's includes warm-up."""
        return None if self.includes_warm_up else self.mean("img_per_s")


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
    """spec: a job's number ('3'), its folder name ('3_amp=true,channels_last=false'), or
    overrides such as 'amp=false,channels_last=false'."""
    names = {
        name
        for job in row.jobs
        for place in (job_place(job.folder),)  # '3_amp=true,...' wherever the folder is
        for name in (job.name, job.folder.name, str(job.folder), short_name(place.name), place.name)
    }
    if spec in names or "=" not in spec:
        return spec in names
    wanted = dict(parse_override(pair) for pair in spec.split(","))
    return any(all(job.overrides.get(key) == value for key, value in wanted.items()) for job in row.jobs)


def choose_baseline(rows: list[Row], spec: str | None) -> tuple[Row | None, str]:
    """The row to compare against, and why it was chosen: among the rows without warm-up in their
    images/s where there are any (else speed-ups cannot be had, only accuracy changes)."""
    with_speed = [row for row in rows if row.mean("img_per_s")]
    steady = [row for row in with_speed if row.speed()]
    measured = steady or with_speed
    if spec:
        chosen = [row for row in rows if matches(row, spec)]
        if len(chosen) != 1:
            names = "; ".join(f"{row.name}: {row.label}" for row in rows)
            raise ReportError(f"--baseline {spec} matches {len(chosen)} rows, not 1 (rows: {names})")
        if chosen[0] not in with_speed:
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
        which = "without warm-up in its images/s" if len(measured) < len(with_speed) else "that completed"
        return min(measured, key=lambda row: row.mean("img_per_s")), f"the slowest {which}"
    return None, "no baseline: no job completed"


def add_comparisons(rows: list[Row], baseline: Row | None) -> None:
    if baseline is None:
        return
    baseline.is_baseline = True
    base_speed, base_acc = baseline.speed(), baseline.mean("test_acc")
    for row in rows:
        for job in row.jobs:
            if job.numbers.get("img_per_s") is not None and not job.includes_warm_up and base_speed:
                job.numbers["speedup"] = job.numbers["img_per_s"] / base_speed
            if job.numbers.get("test_acc") is not None and base_acc is not None:
                job.numbers["test_acc_change"] = job.numbers["test_acc"] - base_acc
