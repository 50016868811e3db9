"""Where a run's compile_s goes: `python -m trainer OVERRIDES`, each run its own process, the
first filling torch's caches and the later ones reading them, then for each run torch's own
compile metrics (dynamo's time per phase, the graphs it made, the cache hits and misses).

    python scripts/compile_breakdown.py model=fastcnn perf=fast recipe=fastcnn_94 data=synthetic
    python scripts/compile_breakdown.py --runs 3 --phases 25 model=resnet18 perf=fast step_graph=true ...

Printed per run: compile_s, startup_s and setup_s from metrics.json, the frames dynamo compiled
and why it recompiled (TORCH_LOGS=recompiles), the FX-graph and AOTAutograd cache hits and
misses, the --phases phases dynamo timed longest (seconds summed over their calls), and the
warm-up's own calls in order (each training step's forward and backward, its optimizer step, the
evaluation; CUDA synchronized around each), which show what of compile_s lies outside dynamo:
loading the compiled kernels at their first call, CUDA graphs recorded, cuDNN's autotuning.

Its runs wrap the warm-up's calls, and a plain `python -m trainer` of the same overrides does
not read in full the caches they wrote: the first plain run after a breakdown compiled in part
anew (compile_s 14.2 and 15.0 s against 3.1-3.7 s, fast CNN, two GPU hosts; record
outputs/readme/gpu_h200x2_h100_2026-11-26i.md). Time plain runs before a breakdown, not after.

A development tool: it decides nothing and writes only under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Runs the trainer's own entry point; at exit (the trainer's exit runs the atexit handlers) it
# writes torch's compile metrics beside metrics.json.
BOOT = """
import atexit, json, os, runpy, sys, time
from trainer import bytecode
bytecode.cache_bytecode()  # before torch, as the trainer's own entry point does
import torch, trainer.loop as loop, trainer.warm_up as warm_up
calls = []
def timed(name, call):
    def synchronized():
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
    def wrapper(*args, **kwargs):
        synchronized()
        started = time.perf_counter()
        result = call(*args, **kwargs)
        synchronized()
        calls.append((name, time.perf_counter() - started))
        return result
    return wrapper
warm_up_steps = warm_up.warm_up_steps
def timed_warm_up_steps(parts, epoch):
    originals = loop.forward_backward, loop.apply_gradients, loop.evaluate
    loop.forward_backward = timed("step", originals[0])
    loop.apply_gradients = timed("optimizer", originals[1])
    loop.evaluate = timed("evaluation", originals[2])
    try:
        warm_up_steps(parts, epoch)
    finally:
        loop.forward_backward, loop.apply_gradients, loop.evaluate = originals
warm_up.warm_up_steps = timed_warm_up_steps
def record():
    from torch._dynamo.utils import compilation_time_metrics, counters
    phases = {name: sum(times) for name, times in compilation_time_metrics.items()}
    groups = ("frames", "stats", "aot_autograd", "inductor")
    kept = {group: dict(counts) for group, counts in counters.items() if group in groups}
    with open(os.environ["COMPILE_BREAKDOWN_OUT"], "w") as out:
        json.dump({"phases": phases, "counters": kept, "warm_up": calls}, out)
atexit.register(record)
sys.argv = ["trainer", *sys.argv[1:]]
runpy.run_module("trainer", run_name="__main__", alter_sys=True)
"""


def one_run(overrides: list[str], folder: Path) -> dict:
    environment = {**os.environ, "COMPILE_BREAKDOWN_OUT": str(folder / "compile.json")}
    environment["TORCH_LOGS"] = "recompiles"
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), environment.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", BOOT, *overrides, f"hydra.run.dir={folder}"],
        capture_output=True,
        text=True,
        env=environment,
    )
    (folder / "output.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0 or not (folder / "compile.json").is_file():
        return {"failed": (result.stderr.strip().splitlines() or ["no output"])[-1]}
    metrics = json.loads((folder / "metrics.json").read_text())
    lines = result.stderr.splitlines()
    recompiles = [line.split("] ", 1)[-1] for line in lines if "Recompiling function" in line]
    return {**json.loads((folder / "compile.json").read_text()), "metrics": metrics, "recompiles": recompiles}


def report(number: int, run: dict, phases: int) -> None:
    if "failed" in run:
        print(f"run {number}: failed: {run['failed']}")
        return
    m = run["metrics"]
    print(
        f"run {number}: compile_s {m['compile_s']:.2f}, startup_s {m.get('startup_s') or 0:.2f}, "
        f"setup_s {m.get('setup_s') or 0:.2f}, train_time_s {m['train_time_s']:.2f}, wall_s {m.get('wall_s')}"
    )
    print(f"  counters: {json.dumps(run['counters'], sort_keys=True)}")
    for line in run["recompiles"]:
        print(f"  recompiled: {line[:160]}")
    longest = sorted(run["phases"].items(), key=lambda item: -item[1])[:phases]
    print("  " + ", ".join(f"{name} {seconds:.2f}" for name, seconds in longest))
    calls = run.get("warm_up", [])
    if not calls:  # ddp=true: the warm-up ran in the ranks, which this process does not reach
        print("  warm-up calls: n/a (not in this process)")
        return
    timed = sum(seconds for _, seconds in calls)
    rest = m["compile_s"] - timed
    print(
        "  warm-up calls: "
        + ", ".join(f"{name} {seconds:.2f}" for name, seconds in calls)
        + f"; the rest of compile_s (the warm-up batches made, the state restored) {rest:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="the run, as for python -m trainer")
    parser.add_argument("--runs", type=int, default=2, help="the first fills the caches where they are cold")
    parser.add_argument("--phases", type=int, default=15, help="dynamo's longest phases to print")
    parser.add_argument("--out", type=Path, default=Path("outputs/compile_breakdown"))
    args = parser.parse_args()
    for number in range(args.runs):
        folder = args.out / f"run-{number}"
        folder.mkdir(parents=True, exist_ok=True)
        report(number, one_run(args.overrides, folder), args.phases)


if __name__ == "__main__":
    main()
