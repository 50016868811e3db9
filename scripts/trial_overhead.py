"""Where a tuner trial's wall time goes, and which exit handler holds the process after its
results are written: `python -m trainer` run as trainer.tune runs a trial, under variants that
each remove one suspect, timed from the outside.

    python scripts/trial_overhead.py model=resnet18 data=synthetic data.train_size=20000 perf=fast

Each variant runs --repeats times (the first run of the command also fills the compile cache,
so a warm-up run goes first). Printed per variant, as medians in seconds from the process start:
Hydra's config written, metrics.json written, the process gone, and the exit (the gap between
the last two); from metrics.json, startup_s (the process before the run's set-up), setup_s
(the assembly), compile_s and the training. Variants:

  plain           the trial as the tuner runs it
  no-bytecode     every start compiles Python's bytecode anew (a bytecode prefix Python may not
                  write to): what an install without bytecode costs where trainer/bytecode.py
                  does not act
  compile-threads TORCHINDUCTOR_COMPILE_THREADS=1: no inductor compile-worker pool to shut down
  os-exit         os._exit once main() returns: no atexit handlers, no interpreter teardown
                  (what is left is the kernel's and the driver's part)
  no-graphs       compile_mode=default: no CUDA graph pools (changes the work; for the exit only)
  forked          the tuner's --trial-start forked (trainer/trial_fork.py): forked from a process
                  that imported the trainer once, ended as multiprocessing ends a child
  forked-bare-server  forked from a server that preloads only what every run imports, not what
                  the model's build imports (torchvision for ResNet-18), which the tuner's has
  forked-no-autotune  forked, with cudnn_benchmark=false: whether cuDNN's autotuning, which can
                  pick other algorithms in another process, is what spreads images/s between trials

Beside the times, each variant's images/s (the trial's own number, epochs after the first): a
variant that changes how the process starts or ends must leave it where plain has it.

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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's trainer

from trainer import bytecode  # noqa: E402

# Before torch is imported, as trainer-tune does at its start: the forkserver and the trials
# forked from it take this process's bytecode prefix. Without it, on a host whose torch has no
# bytecode and whose Python writes none, every forked trial compiled inductor's modules from
# source (the forked variant's 4 s more than plain, outputs/readme/gpu_h100x2_2026-11-26g.md).
bytecode.cache_bytecode()

from trainer import forkserver  # noqa: E402
from trainer.cli_checks import check_composition  # noqa: E402
from trainer.config import register_schema  # noqa: E402
from trainer.trial_fork import forked_trial, start_forkserver  # noqa: E402
from trainer.trials import timed_epochs  # noqa: E402

TRIAL = ["epochs=3", "eval_every=3", "eval.tta=none"]
# main() then os._exit: stdout and stderr flushed first, since os._exit does not
OS_EXIT = (
    "import os, sys\n"
    "sys.argv = ['trainer', *sys.argv[1:]]\n"
    "from trainer import bytecode\n"
    "bytecode.cache_bytecode()\n"
    "from trainer.__main__ import main\n"
    "from trainer.process_exit import exit_code_of\n"
    "code = exit_code_of(main)\n"
    "sys.stdout.flush(); sys.stderr.flush()\n"
    "os._exit(code)\n"
)
NO_BYTECODE = {"PYTHONPYCACHEPREFIX": "{out}/no-bytecode", "PYTHONDONTWRITEBYTECODE": "1"}
VARIANTS = {  # environment, extra overrides, how the trial starts and ends
    "plain": ({}, [], "plain"),
    # every start compiles torch's bytecode anew: a prefix of its own that Python may not write to
    "no-bytecode": (NO_BYTECODE, [], "plain"),
    "compile-threads": ({"TORCHINDUCTOR_COMPILE_THREADS": "1"}, [], "plain"),
    "os-exit": ({}, [], "os-exit"),
    "no-graphs": ({}, ["compile_mode=default"], "plain"),
    "forked": ({}, [], "forked"),
    "forked-bare-server": ({}, [], "forked"),
    "forked-no-autotune": ({}, ["cudnn_benchmark=false"], "forked"),
}


def timed_run(overrides: list[str], folder: Path, env: dict, start_end: str) -> dict:
    start = time.time()
    if start_end == "forked":  # with this process's environment (no variant sets one of its own)
        trial = forked_trial(overrides, folder)
        folder.with_suffix(".log").write_text(trial.stdout + trial.stderr)
        code = trial.returncode
    else:
        plain = start_end != "os-exit"
        head = [sys.executable, *(["-m", "trainer"] if plain else ["-c", OS_EXIT])]
        with open(folder.with_suffix(".log"), "w") as log:
            variables = {name: value.replace("{out}", str(folder.parent)) for name, value in env.items()}
            code = subprocess.call(
                [*head, *overrides, f"hydra.run.dir={folder}"],
                env={**os.environ, **variables},
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
        "startup": numbers.get("startup_s") or 0.0,
        "setup": numbers.get("setup_s") or 0.0,
        "compile": numbers.get("compile_s") or 0.0,
        "train": numbers.get("train_time_s") or 0.0,
        "img/s": statistics.median(epoch["img_per_s"] for epoch in timed_epochs(numbers["history"])),
    }


def cell(column: str, values: list[float]) -> str:
    """The median; images/s with its min-max spread."""
    if not values:
        return ""
    if column == "img/s":
        return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"
    return f"{statistics.median(values):.1f}"


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
    from trainer.models import build_imports  # torch: after the command line's check

    register_schema()
    model_imports = build_imports(check_composition(overrides).model)
    print("warm-up run (fills the compile cache):", timed_run(overrides, args.out / "warm-up", {}, "plain"))
    columns = ("config", "metrics", "gone", "exit", "startup", "setup", "compile", "train", "img/s")
    print(f"| variant | runs | {' | '.join(columns)} |\n| --- | ---: |{' ---: |' * len(columns)}")
    for name in chosen:
        env, extra, start_end = VARIANTS[name]
        if start_end == "forked":  # the variant's server, its imports paid before its first trial
            forkserver.stop()
            start_forkserver(() if name == "forked-bare-server" else model_imports)
        runs = [
            timed_run([*overrides, *extra], args.out / f"{name}-{n}", env, start_end)
            for n in range(args.repeats)
        ]
        done = [run for run in runs if "failed" not in run]
        cells = [cell(c, [run[c] for run in done]) for c in columns]
        failed = [run["failed"] for run in runs if "failed" in run]
        print(f"| {name} | {len(done)} | {' | '.join(cells)} |" + (f" failed: {failed[0]}" if failed else ""))


if __name__ == "__main__":
    main()
