"""Deciding which toggles pay, from settings measured on a Bench (bench.py).

The search: the baseline; each candidate added alone (of a group of alternatives, the best
that pays); the kept ones together; each taken out of that set again, dropped when the rest do
as well without it; then the toggles that did not pay alone, each added to the result;
then larger batches on the result. Settings the time budget leaves no room
for are listed as not measured.

The burden of proof is on change. A toggle joins (alone, or added to the result) only when it
pays beyond the noise; one that paid alone leaves the set only when the set without it is as
fast, within min_gain, not merely within the noise. Where trials spread widely (the fast CNN's
processes of one setting ran 165-201k img/s on one H200, a 20% noise) "within the noise" would
drop a toggle whose set ran 0.84x without it; a preset built that way ran at 0.82x of perf=fast.

Owns: the search and its verdicts. Must not touch: the candidate list (candidates.py), measuring
(bench.py), what is written (output.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.tune.bench import Bench, Setting, Settled
from trainer.tune.candidates import Candidate


class TuneError(Exception):
    """A search that cannot go on (the baseline itself fails): one line for the user."""


def ordered_union(*override_lists: list[str] | tuple[str, ...]) -> list[str]:
    return list(dict.fromkeys(override for overrides in override_lists for override in overrides))


@dataclass
class Outcome:
    settings: list[Setting]  # in the order measured
    kept: list[Candidate]
    final: Setting
    best_batch: Setting | None  # a larger batch that pays, or None


def cannot_pay(bench: Bench) -> Settled:
    """For a setting that counts only when it pays beyond the noise: settled once a majority of
    its repeats ran at or under that gain. Their median will too, and more runs can only widen
    the noise, so no further run can make it pay."""

    def settled(setting: Setting, reference: Setting) -> bool:
        _, noise = bench.ratio_and_noise(setting, reference)
        return bench.majority(setting, reference, lambda ratio: ratio <= 1 + noise)

    return settled


def as_fast_or_not(bench: Bench) -> Settled:
    """For a set without one toggle: settled once a majority of its repeats is on one side of
    "as fast" (within min_gain, a fixed line), where the median of all of them will be too."""
    line = 1 / (1 + bench.min_gain)

    def settled(setting: Setting, reference: Setting) -> bool:
        return bench.majority(setting, reference, lambda ratio: ratio >= line) or bench.majority(
            setting, reference, lambda ratio: ratio < line
        )

    return settled


def add_one(
    bench: Bench, baseline: Setting, candidates: list[Candidate]
) -> tuple[list[Setting], list[Candidate]]:
    """Each candidate alone on the baseline; kept: those that pay, the best of each group."""
    singles = {}
    for candidate in candidates:
        setting = singles[candidate.name] = bench.measure(
            "add one", candidate.name, list(candidate.overrides), against=baseline, settled=cannot_pay(bench)
        )
        if setting.verdict:
            continue
        if bench.compare(setting, baseline):
            setting.verdict = "pays alone"
        else:
            setting.verdict = "within the noise" if setting.ratio and setting.ratio >= 1 else "slower"
    best: dict[str, Candidate] = {}
    for candidate in candidates:
        key, setting = candidate.group or candidate.name, singles[candidate.name]
        if setting.verdict == "pays alone" and (
            key not in best or setting.ratio > singles[best[key].name].ratio
        ):
            best[key] = candidate
    for candidate in candidates:
        winner = best.get(candidate.group or candidate.name)
        if winner is not None and winner is not candidate and singles[candidate.name].verdict == "pays alone":
            singles[candidate.name].verdict = f"pays alone, less than {winner.name}"
    kept = [candidate for candidate in candidates if best.get(candidate.group or candidate.name) is candidate]
    return list(singles.values()), kept


def overrides_of(candidates: list[Candidate]) -> list[str]:
    return ordered_union(*(candidate.overrides for candidate in candidates))


def names_of(candidates: list[Candidate]) -> str:
    return " + ".join(candidate.name for candidate in candidates) or "perf=default"


def as_fast(setting: Setting, min_gain: float) -> bool:
    """Whether the setting ran at least as fast as its reference, within min_gain (compare() first)."""
    return 1 / setting.ratio - 1 <= min_gain


def leave_one_out(bench: Bench, kept: list[Candidate]) -> tuple[list[Setting], list[Candidate], Setting]:
    """The kept set together, then without each of its toggles: one that the rest do as well
    without is dropped, and the remaining set measured once more. Toggles each within the noise
    alone can cost speed together: when the smaller set is slower than the whole, or could not
    be measured, the whole set stays."""
    together = bench.measure("kept together", names_of(kept), overrides_of(kept))
    settings, still = [together], []
    if together.verdict:
        return settings, kept, together
    for candidate in kept:
        without = bench.measure(
            "leave one out",
            f"without {candidate.name}",
            overrides_of([c for c in kept if c is not candidate]),
            against=together,
            settled=as_fast_or_not(bench),
        )
        settings.append(without)
        if without.verdict:
            still.append(candidate)  # not measured: no evidence against it
            continue
        bench.compare(without, together)
        if as_fast(without, bench.min_gain):
            without.verdict = f"drop {candidate.name}: the rest do as well without it"
        elif 1 / without.ratio - 1 > without.noise:
            without.verdict = f"keep {candidate.name}: the set is slower without it"
            still.append(candidate)
        else:
            without.verdict = f"keep {candidate.name}: the set is slower without it, though within the noise"
            still.append(candidate)
    if len(still) == len(kept):
        return settings, kept, together
    final = bench.measure("final", names_of(still), overrides_of(still))
    settings.append(final)
    if final.verdict:  # not measured or failed: no evidence that the smaller set is as fast
        final.verdict += f"; the kept set stands ({names_of(kept)})"
        return settings, kept, together
    bench.compare(final, together)
    if not as_fast(final, bench.min_gain):
        dropped = [candidate.name for candidate in kept if candidate not in still]
        together_word = " together" if len(dropped) > 1 else ""
        final.verdict = (
            f"slower than the kept set: dropping {', '.join(dropped)}{together_word} costs "
            f"{1 - final.ratio:.0%}, so {'they stay' if together_word else 'it stays'}"
        )
        return settings, kept, together
    final.verdict = "the preset"
    return settings, still, final


def add_back(
    bench: Bench, final: Setting, kept: list[Candidate], candidates: list[Candidate], singles: list[Setting]
) -> tuple[list[Setting], list[Candidate], Setting]:
    """Each toggle that did not pay alone, added to the result: some pay only beside others
    (channels_last once amp is on). One faster than the result beyond the noise joins it, and
    the next is tried on top."""
    alone = {setting.label: setting.verdict for setting in singles}
    taken = {candidate.group or candidate.name for candidate in kept}
    settings = []
    for candidate in candidates:
        if (candidate.group or candidate.name) in taken or alone.get(candidate.name) not in (
            "slower",
            "within the noise",
        ):
            continue
        if set(candidate.overrides) <= set(overrides_of(kept)):
            continue  # already on in the result (set_to_none comes with CUDA graphs)
        setting = bench.measure(
            "add back",
            f"+ {candidate.name}",
            overrides_of([*kept, candidate]),
            against=final,
            settled=cannot_pay(bench),
        )
        settings.append(setting)
        if setting.verdict:
            continue
        # one that pays becomes the next one's reference: judged again on all its repeats
        if bench.compare(setting, final) and bench.compare(bench.top_up(setting), final):
            setting.verdict = f"pays on {final.label}: joins"
            kept, final = [*kept, candidate], setting
            taken.add(candidate.group or candidate.name)
        else:
            setting.verdict = f"no faster on {final.label}"
    return settings, kept, final


def larger_batches(
    bench: Bench, final: Setting, batch_sizes: list[int]
) -> tuple[list[Setting], Setting | None]:
    settings, best = [], None
    for batch in batch_sizes:
        setting = bench.measure(
            "batch",
            f"batch_size={batch}",
            [*final.overrides, f"batch_size={batch}"],
            against=best or final,
            settled=cannot_pay(bench),
        )
        settings.append(setting)
        if setting.verdict:
            break  # out of memory or out of time: a larger batch will not do better
        reference = best or final
        # one that is faster becomes the next batch's reference: judged again on all its repeats
        if bench.compare(setting, reference) and bench.compare(bench.top_up(setting), reference):
            setting.verdict = "faster"
            best = setting
        else:
            setting.verdict = "no faster"
            break
    return settings, best


def search(bench: Bench, candidates: list[Candidate], batch_sizes: list[int]) -> Outcome:
    baseline = bench.measure("baseline", "perf=default", [])
    if baseline.verdict.startswith("not measured"):
        raise TuneError("the baseline run found no room in the budget: raise --budget-min")
    if not baseline.img_per_s:
        raise TuneError(
            f"the baseline run (perf=default) gave no numbers ({baseline.summary.get('status')}): "
            f"see {bench.out / 'trials' / '001' / 'output.log'}"
        )
    baseline.verdict = "reference"
    singles, kept = add_one(bench, baseline, candidates)
    settings = [baseline, *singles]
    final = baseline
    if len(kept) == 1:
        final = bench.top_up(next(s for s in singles if s.label == kept[0].name))  # the reference from here
    elif kept:
        together, kept, final = leave_one_out(bench, kept)
        settings += together
    if kept:
        added, kept, final = add_back(bench, final, kept, candidates, singles)
        settings += added
    batches, best_batch = larger_batches(bench, final, batch_sizes)
    return Outcome(settings + batches, kept, final, best_batch)
