"""Where a tuner trial's wall time goes, and which exit handler holds the process after its
results are written: `python -m trainer` run as trainer.tune runs a trial, under variants that
each remove one suspect, timed from the outside.

    python scripts/trial_overhead.py model=resnet18 data=synthetic data.train_size=20000 perf=fast

Each variant runs --repeats times (the first run of the command also fills the compile cache,
so a warm-up run goes first). Printed per variant, as medians in seconds from the process start:
Hydra's config written, metrics.json written, the process gone, and the exit (the gap between
the last two). Variants:

  plain           the trial as the tuner runs it
  compile-threads TORCHINDUCTOR_COMPILE_THREADS=1: no inductor compile-worker pool to shut down
  os-exit         os._exit once main() returns: no atexit handlers, no interpreter teardown
                  (what is left is the kernel's and the driver's part)
  no-graphs       compile_mode=default: no CUDA graph pools (changes the work; for the exit only)

A development tool: it decides nothing and writes only under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

TRIAL = ["epochs=3", "eval_every=3", "eval.tta=none"]
# main() then os._exit: stdout and stderr flushed first, since os._exit does not
OS_EXIT = (
    "import os, sys\n"
    "sys.argv = ['trainer', *sys.argv[1:]]\n"
    "from trainer.__main__ import main\n"
    "code = 0\n"
    "try:\n"
    "    main()\n"
    "except SystemExit as stop:\n"
    "    code = stop.code if isinstance(stop.code, int) else 1\n"
    "sys.stdout.flush(); sys.stderr.flush()\n"
    "os._exit(code)\n"
)
VARIANTS = {
    "plain": ({}, [], False),
    "compile-threads": ({"TORCHINDUCTOR_COMPILE_THREADS": "1"}, [], False),
    "os-exit": ({}, [], True),
    "no-graphs": ({}, ["compile_mode=default"], False),
}


def timed_run(overrides: list[str], folder: Path, env: dict, os_exit: bool) -> dict:
    start = time.time()
    head = [sys.executable, "-c", OS_EXIT] if os_exit else [sys.executable, "-m", "trainer"]
    with open(folder.with_suffix(".log"), "w") as log:
        code = subprocess.call(
            [*head, *overrides, f"hydra.run.dir={folder}"],
            env={**os.environ, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    gone = time.time() - start
    metrics = folder / "metrics.json"
    if code != 0 or not metrics.exists():
        return {"failed": f"exit {code}, see {folder.with_suffix('.log')}"}
    numbers = json.loads(metrics.read_text())
    written = metrics.stat().st_mtime - start
    return {
        "config": (folder / ".hydra" / "config.yaml").stat().st_mtime - start,
        "metrics": written,
        "gone": gone,
        "exit": gone - written,
        "compile": numbers.get("compile_s") or 0.0,
        "train": numbers.get("train_time_s") or 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="the trial's run, as for python -m trainer")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    parser.add_argument("--out", type=Path, default=Path("outputs/trial_overhead"))
    args = parser.parse_args()
    chosen = args.variants.split(",")
    unknown = [name for name in chosen if name not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}: choose from {', '.join(VARIANTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    overrides = [*args.overrides, *TRIAL]
    print("warm-up run (fills the compile cache):", timed_run(overrides, args.out / "warm-up", {}, False))
    columns = ("config", "metrics", "gone", "exit", "compile", "train")
    print(f"| variant | runs | {' | '.join(columns)} |\n| --- | ---: |{' ---: |' * len(columns)}")
    for name in chosen:
        env, extra, os_exit = VARIANTS[name]
        runs = [
            timed_run([*overrides, *extra], args.out / f"{name}-{n}", env, os_exit)
            for n in range(args.repeats)
        ]
        done = [run for run in runs if "failed" not in run]
        cells = [f"{statistics.median(run[c] for run in done):.1f}" if done else "" for c in columns]
        failed = [run["failed"] for run in runs if "failed" in run]
        print(f"| {name} | {len(done)} | {' | '.join(cells)} |" + (f" failed: {failed[0]}" if failed else ""))


if __name__ == "__main__":
    main()
