"""The report's two charts: speedup.png (one bar per row) and accuracy_vs_time.png.

Owns: everything matplotlib (imported by this module only, and this module only once there is
something to draw). Must not touch: the numbers (it plots the rows' means and stds as rows.py
left them) or any file other than the chart it is asked for.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import PercentFormatter

from trainer.report.jobs import Job
from trainer.report.rows import Row


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
        if row.includes_warm_up and not row.mean("speedup"):
            text = "no speed-up: img/s includes warm-up"
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
