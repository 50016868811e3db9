"""The same run again and again, each its own process, until one stalls: then every thread's
stack of it and of the processes under it (`py-spy dump --native`), and the run is killed. For a
hang that comes once in many runs (the warm-up's deadlock of 2026-11-28 came in 2 of 17), which
a single run or a benchmark does not show.

    python scripts/stall_watch.py --runs 40 -- model=resnet18 data=synthetic data.train_size=20000 perf=fast
    python scripts/stall_watch.py --runs 20 --stall-s 60 --keep-going -- model=fastcnn perf=fast

A run has stalled when it has not ended --stall-s seconds after its start (the first run, which
may compile cold, gets --first-stall-s). Printed per run: its wall time from outside, and
wall_s, compile_s and setup_s from its metrics.json; at the end how many ran, how many stalled,
and where each dump is. Exit 1 when one stalled. py-spy is not a dependency: without it on
PATH (`pip install py-spy`), a stalled run is killed all the same and the summary says that no
stack was taken.

A development tool: it decides nothing and writes only under --out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from trainer.process_tree import descendants, kill  # noqa: E402


def stacks(pid: int, spy: str | None) -> str:
    """Each process's command line and, with py-spy, every thread's stack (Python and native)."""
    parts = []
    for each in [pid, *descendants(pid)]:
        try:
            command = Path(f"/proc/{each}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:300]
        except OSError:
            continue  # ended while we looked
        parts.append(f"=== pid {each}: {command}")
        if spy:
            dump = subprocess.run(
                [spy, "dump", "--native", "--pid", str(each)], capture_output=True, text=True, timeout=60
            )
            parts.append(dump.stdout + dump.stderr)
    return "\n".join(parts) + "\n"


def one_run(index: int, overrides: list[str], out: Path, stall_s: float, spy: str | None) -> dict:
    folder = out / f"run{index}"
    log = open(out / f"run{index}.log", "w")  # noqa: SIM115 (the child writes to it until it ends)
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "trainer", *overrides, f"hydra.run.dir={folder}"],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        code = process.wait(timeout=stall_s)
    except subprocess.TimeoutExpired:
        dump = out / f"stall{index}.txt"
        dump.write_text(stacks(process.pid, spy))
        kill([*descendants(process.pid), process.pid])
        process.wait()
        return {"index": index, "stalled": str(dump)}
    finally:
        log.close()
    result = {"index": index, "outside_s": time.perf_counter() - started, "code": code}
    metrics = folder / "metrics.json"
    if metrics.exists():
        numbers = json.loads(metrics.read_text())
        result.update({key: numbers.get(key) for key in ("wall_s", "compile_s", "setup_s")})
    return result


def line(result: dict) -> str:
    if "stalled" in result:
        return f"run {result['index']}: STALLED, stacks in {result['stalled']}"
    figures = " ".join(
        f"{key} {result[key]:.2f}"
        for key in ("wall_s", "compile_s", "setup_s")
        if result.get(key) is not None
    )
    return f"run {result['index']}: {result['outside_s']:.2f} s, exit {result['code']} {figures}".rstrip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="the run, as for python -m trainer (after --)")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--stall-s", type=float, default=30.0, help="a run not ended by then has stalled")
    parser.add_argument("--first-stall-s", type=float, default=180.0, help="the same, for the first run")
    parser.add_argument("--keep-going", action="store_true", help="go on after a stall")
    parser.add_argument("--out", type=Path, default=Path("outputs/stall_watch"))
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    spy = shutil.which("py-spy")
    results = []
    for index in range(args.runs):
        result = one_run(index, args.overrides, out, args.first_stall_s if index == 0 else args.stall_s, spy)
        results.append(result)
        print(line(result), flush=True)
        if "stalled" in result and not args.keep_going:
            break
    stalled = [result for result in results if "stalled" in result]
    ended = [result["outside_s"] for result in results if "outside_s" in result]
    median = f", median {statistics.median(ended):.2f} s" if ended else ""
    unseen = " (no stacks taken: py-spy is not on PATH, pip install py-spy)" if stalled and not spy else ""
    print(f"{len(results)} run(s): {len(ended)} ended{median}, {len(stalled)} stalled{unseen}")
    return 1 if stalled else 0


if __name__ == "__main__":
    sys.exit(main())
