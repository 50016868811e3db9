"""Sweep report: one table, two charts and a one-toggle-at-a-time summary for trainer runs.

    python -m trainer.report outputs/multirun/2026-11-21/05-59-16.850987
    trainer-report SWEEP [MORE_FOLDERS ...] [--out DIR] [--target-acc 0.94]
                   [--baseline amp=false,channels_last=false | --baseline 0]

Every folder holding .hydra/ below the given folders is a job, and so is every job of a sweep
folder below them (its multirun.yaml), wherever the job's folder is (trainer/job_names.py):
its .hydra/overrides.yaml and metrics.json are read. report.md, report.csv, speedup.png and
accuracy_vs_time.png go into the first folder (or --out) and report.md is printed. Jobs that
differ only in `seed` share one row (mean ± std over their completed runs). A job that failed,
was interrupted, is still running or left no metrics.json is listed with its status and no
numbers; it never stops the report.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainer.report.effects import toggle_effects
from trainer.report.jobs import ReportError, load_jobs, recorded_target
from trainer.report.rows import add_comparisons, choose_baseline, differing_keys, group_rows
from trainer.report.tables import markdown_report, write_csv

PROG = "python -m trainer.report"


class OneLineParser(argparse.ArgumentParser):
    """A command-line mistake costs one line (not argparse's usage block) and exit code 2."""

    def error(self, message: str) -> None:
        self.exit(2, f"report: error: {message} (see {PROG} --help)\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineParser(
        prog=PROG,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("folders", nargs="+", type=Path, help="run or sweep folders (searched recursively)")
    parser.add_argument("--out", type=Path, metavar="DIR", help="where to write (default: the first folder)")
    parser.add_argument(
        "--baseline",
        metavar="JOB",
        help="the job to compare against: its number (e.g. 3), its folder name or overrides (e.g. "
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
    from trainer.report.plots import plot_accuracy, plot_speedup  # matplotlib: only once there is a chart

    plot_speedup(rows, out / "speedup.png")
    plot_accuracy(jobs, keys, target_acc, out / "accuracy_vs_time.png")
    print(report)
    print(f"wrote report.md, report.csv, speedup.png, accuracy_vs_time.png to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
