"""Time to accuracy: each row's command over several seeds, each run its own process, one table.

    python scripts/time_to_accuracy.py --data-root ~/cifar10 --seeds 0,1,2 \
        --row "fastcnn_94=model=fastcnn perf=fast recipe=fastcnn_94 target_acc=0.94"

A row is NAME=OVERRIDES. Every run gets data=imagefolder data.root=... data.decode_cache=true
and its seed; results are appended to --out (JSON lines) as they come, so a run cut short keeps
what finished, each with the accuracy of every evaluated epoch ("evaluated", also printed).
The table gives, per row: the seeds' mean, std and min test accuracy (with TTA where the run
uses it), epochs to the target, time to target (the model's initialization from the data,
training and the evaluations it needed, compilation excluded), init_s, compile_s and wall_s
(process start to exit), as medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's trainer.trials

from trainer.trials import append_jsonl, median_of, run_trial, trainer_command  # noqa: E402


def run_once(overrides: list[str], seed: int, data_root: str, folder: Path) -> dict:
    data = ["data=imagefolder", f"data.root={data_root}", "data.decode_cache=true"]
    trial = run_trial(trainer_command([*overrides, *data, f"seed={seed}"], folder), folder)
    metrics = dict(trial.metrics)
    if trial.returncode != 0:
        metrics.setdefault("status", "failed")
        metrics["error_tail"] = (trial.stdout + trial.stderr)[-2000:]
    metrics["process_s"] = trial.process_s
    return metrics


def evaluated(history: list[dict]) -> list[tuple[int, float]]:
    """(epoch, accuracy with TTA where the run uses it) of each evaluated epoch: where a row
    evaluated from an earlier epoch than its target needs, the epoch it could stop at."""
    return [
        (entry["epoch"], entry.get("test_acc_tta") or entry["test_acc"])
        for entry in history
        if entry.get("test_acc") is not None
    ]


def accuracy(metrics: dict) -> float | None:
    return metrics.get("test_acc_tta") or metrics.get("test_acc")


def row_summary(name: str, runs: list[dict]) -> str:
    accuracies = [accuracy(r) for r in runs if accuracy(r) is not None]
    if not accuracies:
        return f"| {name} | {len(runs)} | failed |" + " |" * 10  # the table's 13 columns

    def median(key: str) -> str:
        value = median_of(runs, key)
        return "-" if value is None else f"{value:.2f}"

    std = statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0
    epochs = sorted({r.get("epochs_to_target") for r in runs}, key=lambda e: (e is None, e))
    reached = ", ".join(str(e) for e in epochs)
    return (
        f"| {name} | {len(accuracies)} | {100 * statistics.mean(accuracies):.2f}% | {100 * std:.2f} "
        f"| {100 * min(accuracies):.2f}% | {reached} | {median('time_to_target_s')} "
        f"| {median('init_s')} | {median('train_time_s')} | {median('eval_time_s')} | {median('compile_s')} "
        f"| {median('wall_s')} "
        f"| {median('img_per_s')} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data-root", required=True, help="class folders: <root>/train, <root>/test")
    parser.add_argument("--row", action="append", required=True, help="NAME=OVERRIDES (repeatable)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds for every row")
    parser.add_argument("--out", default="time_to_accuracy.jsonl", help="JSON lines, one per run")
    parser.add_argument(
        "--interleave", action="store_true", help="the rows take turns: seed 0 of each, then seed 1, ..."
    )
    args = parser.parse_args()
    seeds = [int(seed) for seed in args.seeds.split(",")]
    rows = [row.partition("=")[::2] for row in args.row]
    results: dict[str, list[dict]] = {name: [] for name, _ in rows}
    workdir = Path(tempfile.mkdtemp(prefix="tta-"))
    if args.interleave:
        order = [(name, overrides, seed) for seed in seeds for name, overrides in rows]
    else:
        order = [(name, overrides, seed) for name, overrides in rows for seed in seeds]
    for name, overrides, seed in order:
        metrics = run_once(overrides.split(), seed, args.data_root, workdir / f"{name}-{seed}")
        metrics.update(row=name, seed=seed)
        results[name].append(metrics)
        metrics["evaluated"] = evaluated(metrics.pop("history", []))
        append_jsonl(Path(args.out), metrics)
        by_epoch = " ".join(f"{epoch}:{100 * acc:.2f}" for epoch, acc in metrics["evaluated"])
        print(
            f"{name} seed {seed}: {metrics.get('status')} acc {accuracy(metrics)} "
            f"ttt {metrics.get('time_to_target_s')} compile {metrics.get('compile_s')} "
            f"wall {metrics.get('wall_s')} by epoch {by_epoch} {metrics.get('error_tail', '')[-300:]}",
            flush=True,
        )
    print(
        "\n| row | seeds | mean acc | std | min | epochs to target | time to target s | init s | train s "
        "| eval s | compile s | wall s | img/s |"
    )
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, _ in rows:
        print(row_summary(name, results[name]))


if __name__ == "__main__":
    main()
