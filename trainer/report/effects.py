"""One toggle at a time: the mean effect of each swept key in a full factorial.

Owns: deciding whether the rows form a full factorial over two-level keys, and each key's
geometric-mean speed-up and mean accuracy change. Must not touch: the rows themselves (it only
reads their means), formatting (tables.py) or files.
"""

from __future__ import annotations

import itertools
import statistics

from trainer.report.jobs import BOOLEANS
from trainer.report.rows import Row


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
    how many on/off pairs had numbers (images/s with warm-up in it counts as none). None when
    the rows are not such a factorial."""
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
            if on.speed() and off.speed():
                ratios.append(on.speed() / off.speed())
            if on.mean("test_acc") is not None and off.mean("test_acc") is not None:
                changes.append(on.mean("test_acc") - off.mean("test_acc"))
        speedup = statistics.geometric_mean(ratios) if ratios else None
        label = key if (off_level, on_level) == BOOLEANS else f"{key}: {off_level} → {on_level}"
        effects.append((label, speedup, statistics.fmean(changes) if changes else None, len(ratios)))
    return effects
