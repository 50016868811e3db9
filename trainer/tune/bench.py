"""Measuring settings: trials in a time budget, repeated until the comparison is clear.

A setting is the user's run (model, data, any overrides) on perf=default plus some toggles;
it is measured as up to `repeats` trials, each its own process (trainer.trials: images/s without
the first epoch, median and min-max spread). A toggle pays when the setting with it is faster than
the one without by more than the noise: the larger relative spread of the two, and never less
than `min_gain`. A reference (the baseline, the kept set, the result) always gets all its
repeats; a setting compared with one stops repeating once its first run differs from it by more
than CLEAR times the noise (amp's 2.9x needs no second run to be believed), so the repeats go
to the close calls; it also stops once a majority of its repeats lies on one side of the line
that decides it (the search says where, and which side cannot change), since the median of all
of them will lie there too. Trials compare only with trials of the same machine: a resumed tune
reuses none from another host.

Owns: running and reusing trials, the budget, repeats and the comparison of two settings. Must
not touch: which settings to measure or what a comparison decides (search.py), the trial
mechanics (trainer.trials).
"""

from __future__ import annotations

import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from trainer import forkserver
from trainer.report.jobs import parse_override
from trainer.trial_fork import forked_trial, start_forkserver
from trainer.trials import TIMED_OUT, append_jsonl, fresh_trial, median_and_spread, steady_numbers

# How each trial's process starts: a new interpreter, or forked from one that has imported the
# trainer (trainer.trial_fork)
TRIAL_STARTS = {"fresh": fresh_trial, "forked": forked_trial}
# forked where the platform has a forkserver (not Windows): the same images/s as fresh trials in
# a third of the time on one H100 (README, Tuning)
DEFAULT_TRIAL_START = "forked" if forkserver.available() else "fresh"
# A first run this many times the noise away from its reference decides without repeats
CLEAR = 4.0


@dataclass
class Setting:
    phase: str  # baseline, add one, kept together, leave one out, final, batch
    label: str
    overrides: list[str]
    summary: dict = field(default_factory=dict)  # trainer.trials.median_and_spread
    reference: str = ""  # the label this setting is compared against
    ratio: float | None = None  # its images/s over the reference's
    noise: float | None = None  # the relative difference the repeats cannot tell from chance
    verdict: str = ""
    runs: list[dict] = field(default_factory=list)  # each trial's numbers (trainer.trials.steady_numbers)
    cut_short: bool = False  # a trial of it was stopped when the budget ran out

    @property
    def img_per_s(self) -> float | None:
        return self.summary.get("img_per_s")

    def relative_spread(self) -> float:
        if not self.img_per_s or self.summary["runs"] < 2:
            return 0.0
        return (self.summary["max_img_per_s"] - self.summary["min_img_per_s"]) / self.img_per_s


# Whether a setting's runs so far settle its comparison with the reference (search.py decides)
Settled = Callable[["Setting", "Setting"], bool]


def on_top(base: list[str], overrides: list[str]) -> list[str]:
    """base with overrides on top: a key set in both takes the latter's value (Hydra refuses a
    key given twice)."""
    keys = {parse_override(override)[0] for override in overrides}
    return [*(override for override in base if parse_override(override)[0] not in keys), *overrides]


class Bench:
    """Runs settings as trials inside a time budget; every trial's numbers go to trials.jsonl."""

    def __init__(
        self,
        base: list[str],
        out: Path,
        repeats: int,
        budget_s: float,
        min_gain: float,
        earlier: list[dict] | None = None,
        machine: str = "",
        trial_start: str = "fresh",
        preload: tuple[str, ...] = (),
    ):
        self.base, self.out, self.repeats = base, out, repeats
        self.budget_s, self.min_gain, self.machine = budget_s, min_gain, machine
        self.trial_start, self.start = trial_start, TRIAL_STARTS[trial_start]
        self.preload = preload  # what the trials' model imports as it is built: the forkserver's too
        self.to_fork_from = trial_start == "forked"  # the forkserver, until the first trial starts it
        self.started = time.monotonic()
        self.durations: list[float] = []
        # --resume: the trials.jsonl records of a stopped tune of this run, used before any new
        # trial, when they ran on this machine (another host's speeds do not compare with ours) and
        # started the same way.
        # A trial stopped at its time limit was stopped by that tune's budget (a trial's limit is
        # what was left of it): it says nothing about its setting, so it runs again.
        earlier = list(earlier or [])
        self.trials = max((record["trial"] for record in earlier), default=0)
        here = [
            record
            for record in earlier
            if record.get("machine") == machine and record.get("trial_start", "fresh") == self.trial_start
        ]
        self.elsewhere = len(earlier) - len(here)  # set aside: another machine or start, or not saying
        self.earlier = [record for record in here if not record["status"].startswith(TIMED_OUT)]

    def reused(self, overrides: list[str]) -> list[dict]:
        """Up to `repeats` earlier trials of these overrides (each used once), as trial() returns them."""
        found = [record for record in self.earlier if record["overrides"] == overrides][: self.repeats]
        for record in found:
            self.earlier.remove(record)
        skip = ("trial", "setting", "overrides", "base", "machine", "trial_start", "process_s")
        return [{key: value for key, value in record.items() if key not in skip} for record in found]

    def affordable(self) -> bool:
        typical = statistics.median(self.durations) if self.durations else 0.0
        return time.monotonic() - self.started + typical <= self.budget_s

    def measure(
        self,
        phase: str,
        label: str,
        overrides: list[str],
        against: Setting | None = None,
        settled: Settled | None = None,
    ) -> Setting:
        """Up to `repeats` trials of the overrides; with `against` (the reference it will be
        compared with), fewer once the runs so far decide the comparison beyond doubt, or
        `settled` says the rest cannot change its verdict."""
        setting = Setting(phase, label, overrides, runs=self.reused(overrides))
        self.top_up(setting, against, settled)
        if not setting.runs:
            setting.summary = {"runs": 0, "status": "not measured"}
            setting.verdict = "not measured: budget spent" + (
                " (its trial was stopped when it ran out)" if setting.cut_short else ""
            )
            return setting
        print(
            f"tune: {phase:<15} {label:<40} {setting.img_per_s or 0:>10,.0f} img/s "
            f"({setting.summary['runs']} run(s), {time.monotonic() - self.started:.0f} s)",
            flush=True,
        )
        return setting

    def top_up(
        self, setting: Setting, against: Setting | None = None, settled: Settled | None = None
    ) -> Setting:
        """Runs the setting's missing repeats (as the budget allows), or, with `against`, until
        its runs decide the comparison; a setting about to become a reference is topped up to
        all its repeats."""
        while True:
            if setting.runs:
                setting.summary = median_and_spread(setting.runs)
            if len(setting.runs) >= self.repeats or not self.affordable():
                break
            if against is not None and setting.runs and self.clear(setting, against):
                break
            if settled is not None and against is not None and setting.runs and settled(setting, against):
                break
            numbers = self.trial(setting.label, setting.overrides)
            if numbers["status"].startswith(TIMED_OUT):  # its limit is what was left of the budget
                setting.cut_short = True
                break
            setting.runs.append(numbers)
        if setting.runs and not setting.img_per_s:
            setting.verdict = f"failed: {setting.summary['status']}"
        return setting

    def clear(self, setting: Setting, reference: Setting) -> bool:
        """Whether the setting's runs so far differ from the reference by more than CLEAR times
        the noise (a run that failed decides nothing: it is repeated)."""
        if not (setting.img_per_s and reference.img_per_s) or len(setting.runs) != setting.summary["runs"]:
            return False
        ratio, noise = self.ratio_and_noise(setting, reference)
        return abs(ratio - 1) > CLEAR * noise

    def majority(self, setting: Setting, reference: Setting, test: Callable[[float], bool]) -> bool:
        """Whether more than half of `repeats` runs, among those so far, pass `test` on their
        images/s over the reference's: then the median of all of them will pass it too."""
        speeds = [run.get("img_per_s") for run in setting.runs]
        if not reference.img_per_s or not all(speeds):
            return False  # a failed run decides nothing
        return sum(test(speed / reference.img_per_s) for speed in speeds) > self.repeats // 2

    def ratio_and_noise(self, setting: Setting, reference: Setting) -> tuple[float, float]:
        """The setting's images/s over the reference's, and the relative difference their repeats
        cannot tell from chance: the larger relative spread of the two, at least min_gain."""
        noise = max(setting.relative_spread(), reference.relative_spread(), self.min_gain)
        return setting.img_per_s / reference.img_per_s, noise

    def trial(self, label: str, overrides: list[str]) -> dict:
        if self.to_fork_from:
            self.ready_the_forkserver()
        self.trials += 1
        run_dir = self.out / "trials" / f"{self.trials:03d}"
        remaining = max(1.0, self.budget_s - (time.monotonic() - self.started))
        started = time.monotonic()
        trial = self.start(on_top(self.base, overrides), run_dir, remaining)
        self.durations.append(time.monotonic() - started)
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # weights of a timing run: not kept
        numbers = steady_numbers(trial)
        record = {"trial": self.trials, "setting": label, "overrides": overrides, "base": self.base}
        record |= {"machine": self.machine, "trial_start": self.trial_start}
        append_jsonl(self.out / "trials.jsonl", {**record, "process_s": round(trial.process_s, 1), **numbers})
        return numbers

    def ready_the_forkserver(self) -> None:
        """Forked trials: the forkserver started and its imports done before the first trial, so
        that neither that trial's time nor the budget holds them (4.6 s on the 2-core CPU host);
        a --resume whose trials are all on record starts none."""
        waited = time.monotonic()
        start_forkserver(self.preload)
        self.started += time.monotonic() - waited
        self.to_fork_from = False

    def compare(self, setting: Setting, reference: Setting) -> bool:
        """Records setting's images/s over reference's and the noise; whether it is faster beyond it."""
        setting.reference = reference.label
        if not (setting.img_per_s and reference.img_per_s):
            return False
        setting.ratio, setting.noise = self.ratio_and_noise(setting, reference)
        return setting.ratio - 1 > setting.noise
