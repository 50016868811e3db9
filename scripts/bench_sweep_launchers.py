"""One sweep under Hydra's basic launcher (jobs one after another, in one process) and under
hydra/launcher=parallel (jobs side by side), taking turns, in one run: wall time per launcher,
the ratio, and per job (medians from metrics.json) its images/s (a job beside another may run
slower than alone: the table shows by how much) and where its time went: startup_s, setup_s,
compile_s, train_time_s, eval_time_s and the job's wall_s.

    python scripts/bench_sweep_launchers.py --n-jobs 2 --repeats 3
    python scripts/bench_sweep_launchers.py --n-jobs 2 --repeats 2 --warm-up   # neither starts cold
    python scripts/bench_sweep_launchers.py --n-jobs 2 --timeline   # and each job's phases in time
    python scripts/bench_sweep_launchers.py --n-jobs 2 -- model=fastcnn perf=fast recipe=fastcnn_94 \
        data=imagefolder data.root=~/cifar10 seed=0,1,2,3

The sweep is the overrides after `--` (default: 4 seeds of the cnn on synthetic data). The last
two columns are what a sweep costs around its jobs: when its first job's set-up began, in seconds
after Enter, and how long the sweep went on after its last metrics.json (medians over the sweeps).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SWEEP = [
    "model=cnn",
    "data=synthetic",
    "data.train_size=4096",
    "data.test_size=512",
    "batch_size=64",
    "epochs=2",
    "seed=0,1,2,3",
]


def run_sweep(launcher: list[str], sweep: list[str], folder: Path) -> dict:
    """One sweep in its own process: wall seconds, exit code, each job's images/s."""
    env = {**os.environ, "PYTHONPATH": repo_on_path(os.environ.get("PYTHONPATH", ""))}
    started, started_at = time.perf_counter(), time.time()
    result = subprocess.run(
        [sys.executable, "-m", "trainer", "-m", *launcher, *sweep, f"hydra.sweep.dir={folder}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - started
    jobs = []
    for metrics in sorted(folder.glob("*/metrics.json")):
        job = json.loads(metrics.read_text())
        job["written_at_s"] = metrics.stat().st_mtime - started_at  # seconds after Enter
        jobs.append(job)
    tail = result.stderr.strip().splitlines()[-1:] if result.returncode else []
    return {"wall_s": wall, "returncode": result.returncode, "jobs": jobs, "tail": tail}


def repo_on_path(path: str) -> str:
    """PYTHONPATH with this checkout on it, unchanged where it is there already: a served sweep
    runs forked from a server only where its environment, PYTHONPATH included, is the server's."""
    entries = path.split(os.pathsep) if path else []
    if any(Path(entry or ".").resolve() == REPO for entry in entries):
        return path
    return os.pathsep.join([str(REPO), *entries])


EDGE_KEYS = ("written_at_s", "wall_s", "startup_s")  # a job record's figures sweep_edges reads


def sweep_edges(run: dict) -> tuple[float | None, float | None]:
    """(seconds after Enter when the first job's set-up began, seconds from the last
    metrics.json to the sweep's end): what the sweep costs before and after its jobs. A job
    began at its record's time less its wall_s (a process's first job: at the process's start);
    its set-up startup_s later."""
    timed = [job for job in run["jobs"] if all(isinstance(job.get(k), (int, float)) for k in EDGE_KEYS)]
    if not timed:
        return None, None
    first = min(job["written_at_s"] - job["wall_s"] + job["startup_s"] for job in timed)
    return first, run["wall_s"] - max(job["written_at_s"] for job in timed)


# Where a job's time goes (metrics.json): before the run (the process's first job: the
# interpreter and imports; later jobs: their own start), the run's assembly (data, model,
# optimizer), compilation, training, evaluation, and the job from its start to its record.
JOB_PARTS = ("img_per_s", "startup_s", "setup_s", "compile_s", "train_time_s", "eval_time_s", "wall_s")


def job_medians(runs: list[dict]) -> list[str]:
    cells = []
    for key in JOB_PARTS:
        values = [job[key] for run in runs for job in run["jobs"] if isinstance(job.get(key), (int, float))]
        cells.append(
            "-" if not values else f"{statistics.median(values):,.{0 if key == 'img_per_s' else 2}f}"
        )
    return cells


def edge_medians(runs: list[dict]) -> list[str]:
    edges = [sweep_edges(run) for run in runs]
    return [
        "-" if not values else f"{statistics.median(values):.2f}"
        for values in ([edge[side] for edge in edges if edge[side] is not None] for side in (0, 1))
    ]


TIMELINE_PARTS = ("setup_s", "compile_s", "train_time_s", "eval_time_s")


def timeline(name: str, run: dict) -> list[str]:
    """One sweep's jobs as rows in the order they began: the overrides that tell it from the
    sweep's other jobs, the device, when the job began and its set-up began (seconds after
    Enter), how long each part took, what the job spent outside them (checkpoints, the record,
    the process's start for a first job), and when its metrics.json was written."""
    rows = [
        f"\n{name}, its last sweep ({run['wall_s']:.2f} s):",
        "",
        "| job | device | began at | set-up at | set-up | compile | train | eval | other | written at |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    jobs = [job for job in run["jobs"] if all(isinstance(job.get(k), (int, float)) for k in EDGE_KEYS)]
    shared = set.intersection(*(set(job.get("overrides") or []) for job in jobs)) if jobs else set()
    for job in sorted(jobs, key=lambda job: job["written_at_s"] - job["wall_s"]):
        began = job["written_at_s"] - job["wall_s"]
        parts = [job.get(key) or 0.0 for key in TIMELINE_PARTS]
        other = job["wall_s"] - job["startup_s"] - sum(parts)
        overrides = " ".join(o for o in job.get("overrides") or [] if o not in shared) or "-"
        cells = " | ".join(f"{value:.2f}" for value in (began, began + job["startup_s"], *parts, other))
        rows.append(f"| {overrides} | {job.get('device')} | {cells} | {job['written_at_s']:.2f} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n-jobs", type=int, default=2, help="hydra.launcher.n_jobs of the parallel sweep")
    parser.add_argument("--repeats", type=int, default=3, help="sweeps per launcher, taking turns")
    parser.add_argument(
        "--warm-up",
        action="store_true",
        help="first one untimed sweep per launcher: torch's compile cache and Python's bytecode filled "
        "for both, so that neither launcher's first timed sweep pays them",
    )
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="also each job's phases in time, for each launcher's last sweep",
    )
    parser.add_argument("sweep", nargs="*", help="the sweep's overrides (after --)")
    args = parser.parse_args(argv)
    sweep = args.sweep or DEFAULT_SWEEP
    launchers = {
        "basic (one after another)": [],
        f"parallel, n_jobs={args.n_jobs}": [
            "hydra/launcher=parallel",
            f"hydra.launcher.n_jobs={args.n_jobs}",
        ],
    }
    results: dict[str, list[dict]] = {name: [] for name in launchers}
    with tempfile.TemporaryDirectory(prefix="bench-launchers-") as root:
        for number, (name, launcher) in enumerate(launchers.items() if args.warm_up else ()):
            run = run_sweep(launcher, sweep, Path(root) / f"{number}-warm-up")
            wall, code = run["wall_s"], run["returncode"]
            print(f"  {name} | warm-up (untimed): {wall:.1f} s, exit {code}", flush=True)
        for index in range(args.repeats):
            for number, (name, launcher) in enumerate(launchers.items()):
                run = run_sweep(launcher, sweep, Path(root) / f"{number}-{index}")
                results[name].append(run)
                print(
                    f"  {name} | sweep {index + 1}: {run['wall_s']:.1f} s, exit {run['returncode']}",
                    flush=True,
                )
                if run["returncode"]:
                    print(f"  {run['tail']}", file=sys.stderr)
    warmed = ", after an untimed one each" if args.warm_up else ""
    jobs = [job for runs in results.values() for run in runs for job in run["jobs"]]
    served = sum(bool(job.get("served")) for job in jobs)
    how = f"; {served} of {len(jobs)} jobs served by python -m trainer.serve" if served else ""
    if os.environ.get("TRAINER_SERVE") == "1" and not served:
        how = "; TRAINER_SERVE=1 but no job served: no server runs with this environment"
    per_launcher = f"{args.repeats} sweep(s) per launcher{warmed}{how}"
    print(f"\nsweep: {' '.join(sweep)}; {os.cpu_count()} cores, {per_launcher}")
    print()
    print(
        "| launcher | wall s (median) | spread | vs basic | per job (median): images/s | startup s "
        "| setup s | compile s | train s | eval s | job wall s | first set-up at s | after last job s |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    basic = None
    for name, runs in results.items():
        walls = [run["wall_s"] for run in runs]
        median = statistics.median(walls)
        basic = basic or median
        cells = " | ".join([*job_medians(runs), *edge_medians(runs)])
        print(
            f"| {name} | {median:.1f} | {min(walls):.1f}-{max(walls):.1f} | {median / basic:.2f}x | {cells} |"
        )
    for name, runs in results.items() if args.timeline else ():
        print("\n".join(timeline(name, runs[-1])))
    return 0 if all(run["returncode"] == 0 for runs in results.values() for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
