"""What the tuner writes: <out>/perf/tuned.yaml, tune.md, tune.csv and tune.png.

Owns: the files and their wording. Must not touch: the numbers (bench.py measured them,
search.py judged them) or anything outside --out.
"""

from __future__ import annotations

import csv
import shlex
from pathlib import Path

from trainer.atomic import write_atomic
from trainer.trials import fmt, spread
from trainer.tune.bench import Setting
from trainer.tune.search import Outcome


def percent(ratio: float | None) -> str:
    return "" if ratio is None else f"{100 * (ratio - 1):+.1f}%"


def unfinished(outcome: Outcome) -> str:
    """One line when the budget ran out before the search's end, else empty: the preset is then
    the best measured so far, which can be slower than a finished search's (a toggle it would
    have added back is missing)."""
    left = sum(s.verdict.startswith("not measured: budget spent") for s in outcome.settings)
    if not left:
        return ""
    return (
        f"unfinished: the budget ran out with {left} setting(s) not measured, so this is the best "
        "found so far; the same command with --resume continues it on this machine"
    )


# A spread between the runs of one setting beyond which the table's small verdicts tell more
# about the host than about the toggles (the fast CNN's processes spread 17-39% on one H100)
WIDE_SPREAD = 0.10


def spread_note(outcome: Outcome) -> str:
    """One line when the runs of some setting spread widely, else empty: every toggle worth less
    than that spread is then "within the noise", however real it is."""
    widest = max(outcome.settings, key=Setting.relative_spread, default=None)
    if widest is None or widest.relative_spread() <= WIDE_SPREAD:
        return ""
    return (
        f"noisy host: the runs of one setting spread by up to {100 * widest.relative_spread():.0f}% "
        f"here ({widest.label}), so a toggle worth less is within the noise and is not kept"
    )


def yaml_lines(overrides: list[str], comments: dict[str, str]) -> list[str]:
    """A perf preset's lines for dotted overrides (key.sub=value), each with its comment."""
    lines, opened = [], None
    for override in overrides:
        key, value = override.split("=", 1)
        head, _, leaf = key.rpartition(".")
        if head != opened and head:
            lines.append(f"{head}:")
        opened = head
        indent = "  " if head else ""
        comment = comments.get(override)
        lines.append(f"{indent}{leaf or key}: {value}" + (f"  # {comment}" if comment else ""))
    return lines


def tuned_yaml(outcome: Outcome, not_tried: dict[str, str], header: list[str]) -> str:
    singles = {s.label: s for s in outcome.settings if s.phase == "add one"}
    dropped = {s.label.removeprefix("without "): s for s in outcome.settings if s.phase == "leave one out"}
    added = {s.label.removeprefix("+ "): s for s in outcome.settings if s.phase == "add back"}
    final = next((s for s in outcome.settings if s.phase == "final"), None)
    comments, overrides = {}, []
    for candidate in outcome.kept:
        alone = singles[candidate.name]
        said = f"{candidate.name}: alone {percent(alone.ratio)} (noise {100 * alone.noise:.1f}%)"
        if candidate.name in dropped and dropped[candidate.name].ratio:
            said += f"; in the kept set {percent(1 / dropped[candidate.name].ratio)}"
            if dropped[candidate.name].verdict.startswith("drop") and final is not None and final.ratio:
                # it stays although the rest did as well without it: the smaller set, measured again, did not
                said += f"; the set without the dropped ones {percent(final.ratio)}, so it stays"
        if candidate.name in added:
            back = added[candidate.name]
            said += f"; added to the result {percent(back.ratio)} (noise {100 * back.noise:.1f}%)"
        for override in candidate.overrides:
            if override not in overrides:
                overrides.append(override)
                comments[override] = said
    overrides.sort(key=lambda override: ("." in override.split("=", 1)[0], override))
    lines = ["# @package _global_", *(f"# {line}" for line in [*header, unfinished(outcome)] if line)]
    lines += yaml_lines(overrides, comments) or [
        "# no toggle paid beyond the noise: perf=default is the fastest here"
    ]
    if outcome.best_batch:
        batch = outcome.best_batch
        lines.append(
            f"# {batch.label.replace('=', ': ')}  # {fmt(batch.img_per_s, ',.0f')} img/s, "
            f"{percent(batch.ratio)}: not set, since a batch changes the optimization (the lr follows it)"
        )
    lines += [f"# not tried: {name} ({why})" for name, why in not_tried.items()]
    return "\n".join(lines) + "\n"


COLUMNS = ("phase", "setting", "runs", "img/s", "spread", "vs", "speed-up", "noise", "verdict")


def cells(setting: Setting) -> list[str]:
    return [
        setting.phase,
        setting.label,
        str(setting.summary.get("runs", 0)),
        fmt(setting.img_per_s, ",.0f"),
        spread(setting.summary),
        setting.reference,
        "" if setting.ratio is None else f"{setting.ratio:.2f}x",
        "" if setting.noise is None else f"{100 * setting.noise:.1f}%",
        setting.verdict,
    ]


def markdown(outcome: Outcome, not_tried: dict[str, str], header: list[str], command: str) -> str:
    kept = ", ".join(candidate.name for candidate in outcome.kept) or "none"
    lines = [f"# trainer.tune: {kept}", "", *header, "", f"    {command}", ""]
    lines += [f"**{note}**\n" for note in (unfinished(outcome), spread_note(outcome)) if note]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    lines += ["| " + " | ".join(cells(setting)) + " |" for setting in outcome.settings]
    if not_tried:
        lines += ["", "Not tried on this device:", ""] + [
            f"- {name}: {why}" for name, why in not_tried.items()
        ]
    return "\n".join(lines) + "\n"


def write_csv(path: Path, outcome: Outcome) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(COLUMNS)
        writer.writerows(cells(setting) for setting in outcome.settings)


def plot(path: Path, outcome: Outcome) -> None:
    """Speed-up of each toggle alone (add one) and what the kept set loses without it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [s for s in outcome.settings if s.phase in ("add one", "leave one out") and s.ratio]
    figure = Figure(figsize=(8, 1.2 + 0.35 * max(1, len(rows))))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    positions = range(len(rows))[::-1]
    colors = ["tab:blue" if s.phase == "add one" else "tab:orange" for s in rows]
    axes.barh(positions, [s.ratio for s in rows], color=colors)
    axes.set_yticks(list(positions), [f"{s.phase}: {s.label}" for s in rows])
    axes.axvline(1.0, color="gray", linewidth=1)
    axes.set_xlabel("images/s relative to the reference (add one: the baseline; leave one out: the kept set)")
    figure.savefig(path, dpi=100, bbox_inches="tight")


def write_all(
    out: Path, outcome: Outcome, not_tried: dict[str, str], header: list[str], user_overrides: list[str]
) -> str:
    command = shlex.join(["python", "-m", "trainer", "--config-dir", str(out), "perf=tuned", *user_overrides])
    fix = "free disk space or pick another --out"
    preset = tuned_yaml(outcome, not_tried, [*header, "use: " + command])
    write_atomic(out / "perf" / "tuned.yaml", preset.encode(), "the preset", fix)
    report = markdown(outcome, not_tried, header, command)
    write_atomic(out / "tune.md", report.encode(), "the report", fix)
    write_csv(out / "tune.csv", outcome)
    plot(out / "tune.png", outcome)
    return report
