"""GPU throughput ablation: the baseline, each toggle alone on top of it, `perf=fast`, and a
hand-written loop with perf=fast's settings (to show the framework's own overhead).

    python scripts/bench.py                          # ResNet-18, every row, 4 epochs each
    python scripts/bench.py --model cnn --rows baseline,fast,handwritten
    python scripts/bench.py --list                   # the row names

Each row runs `python -m trainer` in its own process on CIFAR-shaped synthetic data
(50,000 training images, as CIFAR-10), so no row inherits another's compiled graphs,
cuDNN plans or allocator state. Images/s is the median over the epochs after the first
(the warm-up: worker start, cuDNN autotuning, compilation). Prints a Markdown table and
writes bench.md and bench.csv into --out.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# name -> overrides on top of the baseline (a plain PyTorch loop, batch 128)
ROWS: dict[str, list[str]] = {
    "baseline": [],
    "amp": ["amp=true"],
    "amp_fp16": ["amp=true", "amp_dtype=fp16"],
    "channels_last": ["channels_last=true"],
    "set_to_none": ["set_to_none=true"],
    "num_workers=8": ["num_workers=8", "persistent_workers=true"],
    "pin_memory": ["num_workers=8", "persistent_workers=true", "pin_memory=true", "non_blocking=true"],
    "prefetch": ["data.prefetch=true", "pin_memory=true", "non_blocking=true", "num_workers=8"],
    "gpu_loader": ["data.loader=gpu"],
    "cudnn_benchmark": ["cudnn_benchmark=true"],
    "tf32": ["tf32=true"],
    "fused_optimizer": ["fused_optimizer=true"],
    "conv_bias=false": ["model.conv_bias=false"],
    "grad_checkpointing": ["model.grad_checkpointing=true"],
    "compile": ["compile=true"],
    "batch_size=512": ["batch_size=512"],
    "fast": ["perf=fast"],
    "fast+compile_default": ["perf=fast", "compile_mode=default"],
    "handwritten": None,  # scripts/handwritten_loop.py with perf=fast's settings
}

COMMON = ["data=synthetic", "data.train_size=50000", "data.test_size=10000", "log_every=100"]


def run_row(
    name: str,
    overrides: list[str] | None,
    model: str,
    epochs: int,
    out: Path,
    timeout_s: float,
    common: list[str] = COMMON,
) -> dict:
    run_dir = out / name.replace("=", "-")
    if overrides is None:
        command = [
            sys.executable,
            str(REPO / "scripts" / "handwritten_loop.py"),
            "--model",
            model,
            "--epochs",
            str(epochs),
            "--out",
            str(run_dir),
        ]
    else:
        command = [
            sys.executable,
            "-m",
            "trainer",
            f"model={model}",
            *common,
            f"epochs={epochs}",
            f"eval_every={epochs}",
            *overrides,
            f"hydra.run.dir={run_dir}",
        ]
    started = time.perf_counter()
    row = {
        "row": name,
        "overrides": "(perf=fast settings, by hand)" if overrides is None else " ".join(overrides),
    }
    try:
        result = subprocess.run(
            command,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"},
        )
    except subprocess.TimeoutExpired:
        return {**row, "wall_s": timeout_s, "status": f"timed out after {timeout_s} s"}
    (out / f"{run_dir.name}.log").write_text(result.stdout + result.stderr)
    row["wall_s"] = round(time.perf_counter() - started, 1)
    metrics_file = run_dir / "metrics.json"
    if result.returncode != 0 or not metrics_file.exists():
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["?"]
        return {**row, "status": f"failed: {tail[0][:120]}"}
    metrics = json.loads(metrics_file.read_text())
    timed = metrics["history"][1:] or metrics["history"]
    waits = [r["data_wait_frac"] for r in timed if r.get("data_wait_frac") is not None]
    return {
        **row,
        "status": metrics["status"],
        "img_per_s": statistics.median(r["img_per_s"] for r in timed),
        "epoch_s": statistics.median(r["epoch_s"] for r in timed),
        "peak_mem_mb": metrics.get("peak_mem_mb"),
        "data_wait_frac": statistics.median(waits) if waits else None,
        "test_acc": metrics.get("test_acc"),
    }


def fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def table(rows: list[dict]) -> str:
    baseline = next((r for r in rows if r["row"] == "baseline" and "img_per_s" in r), None)
    fast = next((r for r in rows if r["row"] == "fast" and "img_per_s" in r), None)
    lines = [
        "| row | overrides | images/s | speed-up | peak mem (MB) | data wait | status |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        speedup = r["img_per_s"] / baseline["img_per_s"] if baseline and "img_per_s" in r else None
        r["speedup"] = speedup
        lines.append(
            f"| {r['row']} | {r['overrides']} | {fmt(r.get('img_per_s'), ',.0f')} | "
            f"{fmt(speedup, '.2f')}{'x' if speedup else ''} | {fmt(r.get('peak_mem_mb'), ',.0f')} | "
            f"{fmt(r.get('data_wait_frac'), '.1%')} | {r['status']} |"
        )
    hand = next((r for r in rows if r["row"] == "handwritten" and "img_per_s" in r), None)
    if fast and hand:
        lines.append("")
        lines.append(
            f"framework overhead at perf=fast settings: trainer {fast['img_per_s']:,.0f} img/s vs "
            f"hand-written {hand['img_per_s']:,.0f} img/s = {fast['img_per_s'] / hand['img_per_s']:.3f}x"
        )
    return "\n".join(lines)


def numeric(row: dict) -> dict:
    def convert(value: str):
        try:
            return float(value)
        except ValueError:
            return value or None

    return {
        key: convert(value) if key not in ("row", "overrides", "status") else value
        for key, value in row.items()
    }


def write_tables(out: Path, header: str, rows: list[dict]) -> None:
    (out / "bench.md").write_text(f"{header}\n\n{table(rows)}\n")
    with open(out / "bench.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=sorted({key for r in rows for key in r}))
        writer.writeheader()
        writer.writerows(rows)


def environment() -> str:
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{gpu}, torch {torch.__version__}, {datetime.now():%Y-%m-%d}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="resnet18", choices=["resnet18", "cnn"])
    parser.add_argument("--epochs", type=int, default=4, help="per row; the first is warm-up")
    parser.add_argument("--rows", default="all", help="comma-separated row names (see --list)")
    parser.add_argument("--out", type=Path, default=None, help="folder for runs, logs and tables")
    parser.add_argument(
        "--row",
        action="append",
        default=[],
        metavar="NAME:OVERRIDES",
        help="an extra row, e.g. 'fast+autotune:perf=fast compile_mode=max_autotune'",
    )
    parser.add_argument("--row-timeout", type=float, default=240, help="seconds before a row is stopped")
    parser.add_argument("--list", action="store_true", help="print the row names and exit")
    parser.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        metavar="BENCH_CSV",
        help="re-render the tables of earlier runs (split across machines calls) as one",
    )
    args = parser.parse_args(argv)
    if args.merge:
        rows = [numeric(row) for path in args.merge for row in csv.DictReader(path.read_text().splitlines())]
        print(table(rows))
        return 0
    for extra in args.row:
        name, _, overrides = extra.partition(":")
        ROWS[name] = overrides.split()
    if args.list:
        print(
            "\n".join(
                f"{name}: {' '.join(o) if o is not None else '(hand-written)'}" for name, o in ROWS.items()
            )
        )
        return 0
    names = list(ROWS) if args.rows == "all" else [name for name in args.rows.split(",") if name]
    names += [extra.partition(":")[0] for extra in args.row]
    unknown = [name for name in names if name not in ROWS]
    if unknown:
        print(f"bench: unknown rows {unknown}; see --list", file=sys.stderr)
        return 2
    if args.epochs < 2:
        print("bench: --epochs must be at least 2 (the first is warm-up)", file=sys.stderr)
        return 2
    out = args.out or REPO / "outputs" / "bench" / f"{datetime.now():%Y-%m-%d_%H-%M-%S}-{args.model}"
    out.mkdir(parents=True, exist_ok=True)
    header = (
        f"{args.model}, {environment()}, {args.epochs} epochs per row (median of the last {args.epochs - 1})"
    )
    print(header, flush=True)
    rows = []
    for name in names:
        rows.append(run_row(name, ROWS[name], args.model, args.epochs, out, args.row_timeout))
        r = rows[-1]
        print(
            f"  {name}: {fmt(r.get('img_per_s'), ',.0f')} img/s ({r['status']}, {r['wall_s']} s)", flush=True
        )
        write_tables(out, header, rows)  # after every row: a stopped bench keeps what it measured
    print("\n" + (out / "bench.md").read_text())
    return 0 if all(r["status"] == "completed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
