"""Find the speed toggles that pay for your run on this machine; write them as a perf preset.

    python -m trainer.tune model=resnet18 data=imagefolder data.root=~/cifar10 --budget-min 20
    trainer-tune model=cnn --out tuned --toggles amp,channels_last --repeats 2
    python -m trainer --config-dir tuned perf=tuned model=cnn        # train with what it found

Every trial is `python -m trainer` with your overrides on perf=default, run for --epochs epochs
(images/s over the epochs after the first), up to --repeats times: references (the baseline, the
kept set, the result) get all of them, a setting whose first run is 4x the noise away from its
reference no more. Each toggle is added alone; those faster than the baseline by more than the
noise (the larger min-max spread of the two, at least --min-gain) are kept, the best of
alternatives (compile modes); the kept set is measured together and without each of its toggles,
and a toggle the rest do as well without is dropped (unless the smaller set, measured again, is
slower than the whole: then all stay); each toggle that did not pay alone is then added to the
result and kept where it pays there. Then larger batches are tried on the result (reported, not
set: a batch changes the optimization). Writes <out>/perf/tuned.yaml (a comment per line: what it
measured), tune.md, tune.csv, tune.png and trials.jsonl (every trial as it ends). Toggles that
cannot act on the device are listed with the reason; trials the --budget-min leaves no room for
are listed as not measured. `--resume` continues a tune in --out that its budget or a stop cut
short: the trials it finished on this machine are used first, then the rest are run.
Each trial is forked from one process that imported the trainer once (trainer/trial_fork.py):
seconds less a trial than a new interpreter, which `--trial-start fresh` starts instead.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from datetime import datetime
from pathlib import Path

from trainer import bytecode, process_exit
from trainer.cli_checks import check_composition
from trainer.config import ConfigError, register_schema
from trainer.report.jobs import parse_override
from trainer.tune.bench import DEFAULT_TRIAL_START, TRIAL_STARTS, Bench
from trainer.tune.candidates import NAMES, pick, split_for

PROG = "python -m trainer.tune"
# Keys the tuner sets on every trial, or picks itself
RESERVED = ("perf", "epochs", "eval_every", "eval.tta", "hydra.")


class OneLineParser(argparse.ArgumentParser):
    """A command-line mistake costs one line (not argparse's usage block) and exit code 2."""

    def error(self, message: str) -> None:
        self.exit(2, f"tune: error: {message} (see {PROG} --help)\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "overrides", nargs="*", help="the run to tune, as for python -m trainer (model=, data=, ...)"
    )
    parser.add_argument("--out", type=Path, help="where to write (default: outputs/tune/<date>/<time>)")
    parser.add_argument(
        "--budget-min", type=float, default=30.0, help="stop starting trials after this (default 30)"
    )
    parser.add_argument(
        "--epochs", type=int, default=3, help="epochs per trial, the first left out (default 3)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="trials per setting, at most (default 3; fewer where clear)"
    )
    parser.add_argument(
        "--min-gain",
        type=float,
        default=0.02,
        help="least speed-up that counts; a set that loses less without a toggle drops it (default 0.02)",
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue the stopped tune in --out: its trials are used first"
    )
    parser.add_argument(
        "--trial-start",
        choices=tuple(TRIAL_STARTS),
        default=DEFAULT_TRIAL_START,
        help=f"how each trial starts (default here: {DEFAULT_TRIAL_START}): forked from one process that "
        "imported the trainer once, seconds less a trial (trainer/trial_fork.py; where the platform has "
        "a forkserver), or fresh, a new `python -m trainer`",
    )
    parser.add_argument("--toggles", help=f"comma-separated subset of: {', '.join(NAMES)} (default: all)")
    parser.add_argument(
        "--batch-sizes",
        default="auto",
        help="batch sizes to try on the result: comma-separated, none, or auto (2x and 4x the run's)",
    )
    args = parser.parse_args(argv)
    if args.epochs < 2:
        parser.error("--epochs must be at least 2: the first epoch is warm-up and left out")
    if args.repeats < 1 or args.budget_min <= 0 or not 0 <= args.min_gain < 1:
        parser.error("--repeats must be at least 1, --budget-min above 0 and --min-gain in [0, 1)")
    for override in args.overrides:
        key = parse_override(override)[0]
        if override.startswith("-") or any(
            key == r or (r.endswith(".") and key.startswith(r)) for r in RESERVED
        ):
            parser.error(
                f"'{override}': the tuner sets {key.rstrip('.') or override} itself (trials run on "
                "perf=default with --epochs): leave it out"
            )
    return args


def batch_sizes(spec: str, batch_size: int) -> list[int]:
    if spec == "auto":
        return [2 * batch_size, 4 * batch_size]
    if spec == "none":
        return []
    try:
        sizes = [int(size) for size in spec.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"--batch-sizes must be auto, none or whole numbers like 256,512; got '{spec}'")
    return sizes


def prepare_out(out: Path, resume: bool) -> Path:
    out = out.expanduser().absolute()
    if (out / "trials.jsonl").exists() and not resume:
        raise ConfigError(
            f"{out} already holds a tune (trials.jsonl): pick another --out, or add --resume to continue it"
        )
    if resume and not (out / "trials.jsonl").is_file():
        raise ConfigError(f"--resume: {out} holds no trials.jsonl to continue: leave out --resume")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"cannot make {out} ({error.strerror}): pick another --out") from None
    return out


def earlier_trials(out: Path, base: list[str]) -> list[dict]:
    """The trials a stopped tune in `out` finished, when it tuned this same run (same overrides,
    epochs); a line cut off by the stop is left out."""
    records = []
    for line in (out / "trials.jsonl").read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    other = next((record.get("base") for record in records if record.get("base") != base), None)
    if other is not None or any("base" not in record for record in records):
        raise ConfigError(
            f"--resume: the tune in {out} ran {' '.join(other or ['(unknown)'])}, not {' '.join(base)}: "
            "resume with the same overrides and --epochs, or pick another --out"
        )
    return records


class Stopped(BaseException):
    """SIGTERM (a scheduler, `kill`), raised where the tuner waits for a trial, as Ctrl-C is."""


def stop_on_sigterm(_signal: int, _frame) -> None:
    raise Stopped


def cuda_here() -> bool:
    import torch  # only once the command line has passed its checks

    return torch.cuda.is_available()


def say_what_is_reused(bench: Bench, out: Path, resumed: bool) -> None:
    """With --resume: how many earlier trials count, and how many do not, and why."""
    if resumed:
        print(f"tune: resuming: {len(bench.earlier)} earlier trial(s) in {out} are used first", flush=True)
    if bench.elsewhere:
        print(
            f"tune: {bench.elsewhere} earlier trial(s) ran on another machine or with another --trial-start "
            "(or do not say) and are not used: hosts of one GPU kind differ by up to 1.5x; their settings "
            "run again here",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    register_schema()
    try:
        candidates = pick(args.toggles)
        cfg = check_composition([*args.overrides, "perf=default"])
        sizes = batch_sizes(args.batch_sizes, cfg.batch_size)
        if args.resume and not args.out:
            raise ConfigError("--resume continues the tune in --out: give --out")
        default_out = Path("outputs") / "tune" / f"{datetime.now():%Y-%m-%d/%H-%M-%S}"
        out = prepare_out(args.out or default_out, args.resume)
        base = [*args.overrides, f"epochs={args.epochs}", f"eval_every={args.epochs}", "eval.tta=none"]
        earlier = earlier_trials(out, base) if args.resume else []
    except (ConfigError, ValueError) as error:
        print(f"tune: error: {error}", file=sys.stderr)
        return 2
    from trainer.models import build_imports
    from trainer.trials import environment, machine  # torch, once the command line has passed
    from trainer.tune.output import spread_note, unfinished, write_all
    from trainer.tune.search import TuneError, search

    device = "cuda" if cfg.device.startswith("cuda") or (cfg.device == "auto" and cuda_here()) else "cpu"
    fixed_keys = {parse_override(override)[0] for override in args.overrides}
    split = split_for(candidates, device, cfg.model.target is not None, fixed_keys)
    header = [
        f"{environment()}; {args.epochs} epochs a trial (images/s over epochs 2-{args.epochs}), "
        f"up to {args.repeats} trial(s) a setting ({args.trial_start} processes), "
        f"noise at least {100 * args.min_gain:.0f}%",
        f"run: {' '.join(args.overrides) or '(no overrides)'} on perf=default",
    ]
    bench = Bench(
        base, out, args.repeats, 60 * args.budget_min, args.min_gain, earlier, machine(),
        trial_start=args.trial_start, preload=build_imports(cfg.model),
    )  # fmt: skip
    say_what_is_reused(bench, out, bool(earlier))
    print(f"tune: {len(split.tryable)} toggle(s) to try on {device}, writing to {out}", flush=True)
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        outcome = search(bench, split.tryable, sizes)
    except TuneError as error:
        print(f"tune: error: {error}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Stopped) as stop:  # the trial in flight was killed on the way out
        print(
            f"tune: stopped: the trials that finished are in {out / 'trials.jsonl'}; the same command "
            "with --resume continues",
            file=sys.stderr,
        )
        return 130 if isinstance(stop, KeyboardInterrupt) else 143
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    print(write_all(out, outcome, split.not_tried, header, args.overrides))
    notes = [
        f"wrote perf/tuned.yaml, tune.md, tune.csv, tune.png to {out}",
        unfinished(outcome),
        spread_note(outcome),
    ]
    print("\n".join(f"tune: {note}" for note in notes if note), file=sys.stderr)
    return 0


def cli() -> None:
    """`python -m trainer.tune` and `trainer-tune`: main, then the process ends as soon as
    tuned.yaml and its notes are written (trainer/process_exit.py); torch's bytecode cached
    where its install has none (trainer/bytecode.py)."""
    bytecode.cache_bytecode()
    process_exit.run(main)


if __name__ == "__main__":
    cli()
