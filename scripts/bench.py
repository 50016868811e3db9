"""GPU throughput: the trainer beside hand-written peers, and what each toggle buys.

    python scripts/bench.py --data-root ~/cifar10 --sections peers,default --repeats 3
    python scripts/bench.py --data-root ~/cifar10 --sections added,removed,files
    python scripts/bench.py --list                   # the sections and their rows
    python scripts/bench.py --merge a/bench.csv b/bench.csv --pool   # one row over both calls' runs

Sections (each row runs `python -m trainer`, or a hand-written loop, in its own process, so
no row inherits another's compiled graphs, cuDNN plans or allocator state):

  peers    the trainer against scripts/handwritten_loop.py at identical settings: the classic
           torchvision pipeline (2 workers, fp32 with TF32 convolutions, batch 128), the same
           with the usual checklist (8 workers, pinned memory, non-blocking copies, fp16 AMP,
           channels_last, set_to_none, cuDNN autotuning, batch 512), perf=fast, perf=fast
           with every epoch at 24x24 (data.low_res, progressive resizing's small epochs), and
           perf=fast with optim=muon as recipe=resnet18_94 runs it (step_graph=true) against a
           hand-written Muon step compiled into a CUDA graph (scripts/handwritten_muon.py)
  default  `python -m trainer` with no override, and with amp=true
  added    each toggle added to a fed baseline (perf=default: fp32, batch 128, num_workers=auto)
  removed  each toggle taken out of perf=fast (leave-one-out)
  files    images decoded from their files every epoch (data.decode=every_epoch): where
           DataLoader workers matter
  tuned    perf=fast beside the preset `python -m trainer.tune` wrote (--tuned DIR: its --out),
           both at batch 512: python scripts/bench.py --sections tuned --tuned DIR

Images/s of a run is the median over its epochs after the first (warm-up: worker start,
cuDNN autotuning, compilation); with --repeats N the row shows the median of the N runs and
their spread (min-max). Speed-up is against the section's reference row. With --interleave the
rows take turns (run 1 of each, then run 2 of each, ...), so that a drift of the host falls on
all of them alike. Writes bench.md and bench.csv into --out after every row (or round), so a
stopped bench keeps what it measured.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the trainer of this checkout, for the runner and for every row

from trainer.trials import (  # noqa: E402
    environment,
    fmt,
    median_and_spread,
    repeat,
    rounds,
    run_trial,
    spread,
    steady_numbers,
    trainer_command,
)


@dataclass
class Row:
    name: str
    trainer: list[str] | None = None  # overrides for `python -m trainer`
    handwritten: list[str] | None = None  # arguments for scripts/handwritten_loop.py

    def describe(self) -> str:
        if self.handwritten is not None:
            return "hand-written: " + " ".join(self.handwritten)
        return " ".join(self.trainer) or "(no overrides)"


CLASSIC = ["perf=baseline", "num_workers=2", "persistent_workers=true", "tf32=true"]
CHECKLIST = [
    "perf=baseline",
    "num_workers=8",
    "persistent_workers=true",
    "pin_memory=true",
    "non_blocking=true",
    "amp=true",
    "amp_dtype=fp16",
    "channels_last=true",
    "set_to_none=true",
    "cudnn_benchmark=true",
    "tf32=true",
    "batch_size=512",
]
HAND_CHECKLIST = [
    "--loader", "classic", "--workers", "8", "--pin-memory", "--amp", "fp16", "--channels-last",
    "--set-to-none", "--cudnn-benchmark", "--batch-size", "512",
]  # fmt: skip

# optim=muon at recipe=resnet18_94's settings, scripts/handwritten_loop.py's Muon defaults
MUON = ["optim=muon", "optim.muon_lr=0.12", "optim.muon_momentum=0.6", "optim.muon_fixed_norm=true",
        "optim.muon_ns_steps=3"]  # fmt: skip
# section -> rows; the first row of a section is its reference for the speed-up
SECTIONS: dict[str, list[Row]] = {
    "peers": [
        Row("classic: hand-written", handwritten=["--loader", "classic", "--workers", "2"]),
        Row("classic: trainer", CLASSIC),
        Row("checklist: hand-written", handwritten=HAND_CHECKLIST),
        Row("checklist: trainer", CHECKLIST),
        Row("fast: hand-written", handwritten=["--loader", "gpu"]),
        Row("fast: trainer", ["perf=fast"]),
        # every epoch at 24x24 (recipe=resnet18_94 trains its first 14 so): the downscaling's cost
        Row(
            "low-res: hand-written",
            handwritten=["--loader", "gpu", "--low-res", "24", "--low-res-epochs", "99"],
        ),
        Row("low-res: trainer", ["perf=fast", "data.low_res=24", "data.low_res_epochs=99"]),
        # optim=muon as recipe=resnet18_94 steps it (its Muon settings, the step a CUDA graph)
        Row("muon: hand-written", handwritten=["--loader", "gpu", "--optimizer", "muon"]),
        Row("muon: trainer", ["perf=fast", "step_graph=true", *MUON]),
    ],
    "default": [
        Row("default", []),
        Row("default + amp", ["amp=true"]),
    ],
    "added": [
        Row("fed baseline", []),
        Row("+ amp (bf16)", ["amp=true"]),
        Row("+ amp fp16", ["amp=true", "amp_dtype=fp16"]),
        Row("+ channels_last", ["channels_last=true"]),
        Row("+ amp + channels_last", ["amp=true", "channels_last=true"]),
        Row("+ tf32", ["tf32=true"]),
        Row("+ cudnn_benchmark", ["cudnn_benchmark=true"]),
        Row("+ batch_size=512", ["batch_size=512"]),
        Row("+ compile", ["compile=true"]),
        Row("+ fused_optimizer", ["fused_optimizer=true"]),
        Row("+ set_to_none", ["set_to_none=true"]),
        Row("+ conv_bias=false", ["model.conv_bias=false"]),
        Row("+ pin_memory + non_blocking", ["pin_memory=true", "non_blocking=true"]),
        Row("+ data.prefetch", ["data.prefetch=true", "pin_memory=true", "non_blocking=true"]),
        Row("+ data.loader=gpu", ["data.loader=gpu"]),
        Row("+ grad_checkpointing", ["model.grad_checkpointing=true"]),
    ],
    "removed": [
        Row("perf=fast", ["perf=fast"]),
        Row("- amp", ["perf=fast", "amp=false"]),
        Row("- channels_last", ["perf=fast", "channels_last=false"]),
        Row("- data.loader=gpu (DataLoader, auto workers)", ["perf=fast", "data.loader=torch"]),
        Row("- compile", ["perf=fast", "compile=false"]),
        Row("- CUDA graphs (compile_mode=default)", ["perf=fast", "compile_mode=default"]),
        Row("- batch_size=512 (128)", ["perf=fast", "batch_size=128"]),
        Row("- cudnn_benchmark", ["perf=fast", "cudnn_benchmark=false"]),
        Row("- tf32", ["perf=fast", "tf32=false"]),
        Row("- fused_optimizer", ["perf=fast", "fused_optimizer=false"]),
        Row("- conv_bias=false", ["perf=fast", "model.conv_bias=true"]),
    ],
    "files": [
        Row("every_epoch, num_workers=0", ["data.decode=every_epoch", "num_workers=0", "amp=true"]),
        Row("every_epoch, num_workers=4", ["data.decode=every_epoch", "num_workers=4", "amp=true"]),
        Row(
            "every_epoch, num_workers=12",
            ["data.decode=every_epoch", "num_workers=12", "persistent_workers=true", "amp=true"],
        ),
        Row("decoded once (default)", ["amp=true"]),
    ],
}

SYNTHETIC = ["data=synthetic", "data.train_size=50000", "data.test_size=10000"]
# The peers' recipe (scripts/handwritten_loop.py), which every trainer row trains with, so that
# a row and its peer differ only in who runs the loop: lr 0.05 per 128 images, no label
# smoothing, a random flip each epoch, no TTA.
PEER_RECIPE = ["optim.lr=0.05", "optim.label_smoothing=0", "data.flip=random", "eval.tta=none"]


def tuned_section(tuned: Path) -> list[Row]:
    """perf=fast, the reference, and the tuner's preset at perf=fast's batch (the tuner reports a
    batch size but does not set it)."""
    if not (tuned / "perf" / "tuned.yaml").is_file():
        raise SystemExit(f"bench: no perf/tuned.yaml in {tuned}: pass the folder trainer.tune --out wrote")
    return [
        Row("perf=fast", ["perf=fast"]),
        Row("perf=tuned", [f"--config-dir={tuned.resolve()}", "perf=tuned", "batch_size=512"]),
    ]


def command(row: Row, data: list[str], model: str, epochs: int, run_dir: Path) -> list[str]:
    """The row's process: the trainer, or its hand-written peer, at the same settings."""
    if row.handwritten is None:
        flags = [item for item in row.trainer if item.startswith("--")]  # before the overrides
        overrides = [f"model={model}", *data, "log_every=100", f"epochs={epochs}", f"eval_every={epochs}"]
        settings = [item for item in row.trainer if item not in flags]
        return trainer_command([*flags, *overrides, *PEER_RECIPE, *settings], run_dir)
    peer = [sys.executable, str(REPO / "scripts" / "handwritten_loop.py"), *row.handwritten]
    peer += ["--model", model, "--epochs", str(epochs), "--out", str(run_dir)]
    root = next((item.split("=", 1)[1] for item in data if item.startswith("data.root=")), None)
    return peer + (["--data-root", root] if root else [])


def run_once(row: Row, data: list[str], model: str, epochs: int, run_dir: Path, timeout_s: float) -> dict:
    """One process; its images/s (median over the epochs after the first), or why it failed."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
    trial = run_trial(command(row, data, model, epochs, run_dir), run_dir, timeout_s, cwd=REPO, env=env)
    return steady_numbers(trial)


def row_runner(section: str, row: Row, args, data: list[str], out: Path) -> Callable[[int], dict]:
    """The row's run number `index`, in its own folder."""
    slug = "".join(c if c.isalnum() else "-" for c in row.name).strip("-")

    def run(index: int) -> dict:
        return run_once(
            row, data, args.model, args.epochs, out / section / f"{slug}-{index}", args.row_timeout
        )

    return run


# What a row was measured on, beside its settings: rows are pooled only where all of them agree.
MEASURED_ON = ("model", "epochs", "environment")


def row_result(section: str, row: Row, runs: list[dict], measured_on: dict | None = None) -> dict:
    """The table row; each run's images/s too (img_per_s_each) and what it was measured on
    (MEASURED_ON), so that --merge --pool can join a row's runs from several calls."""
    each = " ".join(f"{run['img_per_s']:.0f}" for run in runs if "img_per_s" in run)
    summary = median_and_spread(runs)
    return {
        "section": section,
        "row": row.name,
        "settings": row.describe(),
        **summary,
        "img_per_s_each": each,
        **(measured_on or {}),
    }


def pooled(rows: list[dict]) -> list[dict]:
    """Rows of one section and name from several benches as one row over all their runs: a
    lease's calls are 10 minutes each, so a row's repeats are often split over calls. Images/s
    is the median and min-max of every run; peak memory and data wait the median of the rows'
    medians (a run's own are not kept). Rows join only where their settings, model, epochs and
    environment (GPU, torch, date) agree; the others, and rows of older tables without
    img_per_s_each, stay apart."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        same = (row["section"], row["row"], row["settings"], *(str(row.get(key)) for key in MEASURED_ON))
        key = same if row.get("img_per_s_each") else (id(row),)
        groups.setdefault(key, []).append(row)
    result = []
    for members in groups.values():
        if len(members) == 1:
            result.append(members[0])
            continue
        rates = [float(value) for member in members for value in str(member["img_per_s_each"]).split()]
        failed = sum(1 for member in members if member["status"] != "completed")
        medians = {
            key: statistics.median(values) if values else None
            for key in ("peak_mem_mb", "data_wait_frac")
            for values in [[member[key] for member in members if member.get(key) is not None]]
        }
        result.append(
            {
                **members[0],
                "runs": len(rates),
                "status": "completed" if not failed else f"{failed} pooled row(s) had failed runs",
                "img_per_s": statistics.median(rates),
                "min_img_per_s": min(rates),
                "max_img_per_s": max(rates),
                **medians,
                "img_per_s_each": " ".join(f"{rate:.0f}" for rate in rates),
            }
        )
    return result


def run_row(section: str, row: Row, args, data: list[str], out: Path) -> dict:
    """The row's --repeats runs, back to back, as one table row."""
    runs = repeat(row_runner(section, row, args, data, out), args.repeats, f"{section} | {row.name}")
    return row_result(section, row, runs)


def table(rows: list[dict]) -> str:
    lines = []
    for section in dict.fromkeys(r["section"] for r in rows):
        members = [r for r in rows if r["section"] == section]
        reference = members[0].get("img_per_s")
        lines += [
            f"**{section}**",
            "",
            "| row | settings | runs | images/s (median) | spread (min-max) | speed-up | peak mem (MB) "
            "| data wait |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in members:
            rate = r.get("img_per_s")
            speedup = rate / reference if rate and reference else None
            status = "" if r["status"] == "completed" else f" ({r['status']})"
            runs = int(r["runs"])
            lines.append(
                f"| {r['row']}{status} | {r['settings']} | {runs} | {fmt(rate, ',.0f')} | {spread(r)} | "
                f"{fmt(speedup, '.2f')}{'x' if speedup else ''} | {fmt(r.get('peak_mem_mb'), ',.0f')} | "
                f"{fmt(r.get('data_wait_frac'), '.1%')} |"
            )
        pairs = [(r, p) for r in members for p in members if r["row"].endswith(": trainer")
                 and p["row"] == r["row"].replace(": trainer", ": hand-written")]  # fmt: skip
        for ours, peer in pairs:
            if ours.get("img_per_s") and peer.get("img_per_s"):
                lines.append(
                    f"\n{ours['row'].split(':')[0]}: trainer / hand-written = "
                    f"{ours['img_per_s'] / peer['img_per_s']:.2f}x"
                )
        lines.append("")
    return "\n".join(lines)


def numeric(row: dict) -> dict:
    def convert(value: str):
        try:
            return float(value)
        except ValueError:
            return value or None

    text = ("section", "row", "settings", "status", "img_per_s_each", "model", "environment")
    return {key: convert(value) if key not in text else value for key, value in row.items()}


def write_tables(out: Path, header: str, rows: list[dict]) -> None:
    (out / "bench.md").write_text(f"{header}\n\n{table(rows)}\n")
    with open(out / "bench.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(dict.fromkeys(key for r in rows for key in r)))
        writer.writeheader()
        writer.writerows(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="resnet18", choices=["resnet18", "cnn", "fastcnn"])
    parser.add_argument("--data-root", default=None, help="class folders (train/, test/); default synthetic")
    parser.add_argument("--sections", default="peers,default", help=f"comma-separated: {', '.join(SECTIONS)}")
    parser.add_argument("--rows", default=None, help="only rows whose name contains one of these (a,b,...)")
    parser.add_argument("--epochs", type=int, default=3, help="per run; the first is warm-up")
    parser.add_argument("--repeats", type=int, default=3, help="runs per row")
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="run 1 of every row, then run 2 of every row, ...: a drift of the host falls on all rows alike",
    )
    parser.add_argument("--out", type=Path, default=None, help="folder for runs, logs and tables")
    parser.add_argument("--row-timeout", type=float, default=300, help="seconds before a run is stopped")
    parser.add_argument("--tuned", type=Path, default=None, help="tuned section: the tuner's --out folder")
    parser.add_argument("--list", action="store_true", help="print the sections and rows, then exit")
    parser.add_argument("--merge", nargs="+", type=Path, metavar="BENCH_CSV", help="re-render earlier tables")
    parser.add_argument(
        "--pool",
        action="store_true",
        help="with --merge: rows of one section and name in several tables become one row over all runs",
    )
    args = parser.parse_args(argv)
    if args.pool and not args.merge:
        print("bench: --pool goes with --merge BENCH_CSV ... (the tables to pool)", file=sys.stderr)
        return 2
    if args.merge:
        missing = [str(path) for path in args.merge if not path.is_file()]
        if missing:
            print(f"bench: no such bench.csv: {', '.join(missing)}", file=sys.stderr)
            return 2
        rows = [numeric(row) for path in args.merge for row in csv.DictReader(path.read_text().splitlines())]
        print(table(pooled(rows) if args.pool else rows))
        return 0
    if args.list:
        for section, rows in SECTIONS.items():
            print(section)
            print("\n".join(f"  {row.name}: {row.describe()}" for row in rows))
        return 0
    if args.tuned:
        SECTIONS["tuned"] = tuned_section(args.tuned)
    sections = [name for name in args.sections.split(",") if name]
    if "tuned" in sections and "tuned" not in SECTIONS:
        print("bench: the tuned section needs --tuned DIR (the tuner's --out folder)", file=sys.stderr)
        return 2
    unknown = [name for name in sections if name not in SECTIONS]
    if unknown:
        print(f"bench: unknown sections {unknown}; choose from {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    if args.epochs < 2:
        print("bench: --epochs must be at least 2 (the first is warm-up)", file=sys.stderr)
        return 2
    data = SYNTHETIC
    if args.data_root:
        data = ["data=imagefolder", f"data.root={args.data_root}", "data.decode_cache=true"]
    out = args.out or REPO / "outputs" / "bench" / f"{datetime.now():%Y-%m-%d_%H-%M-%S}-{args.model}"
    out.mkdir(parents=True, exist_ok=True)
    source = args.data_root or "synthetic CIFAR-shaped images (50,000)"
    header = (
        f"{args.model} on {source}, {environment()}; {args.epochs} epochs per run "
        f"(median of the last {args.epochs - 1}), {args.repeats} run(s) per row"
        + (", the rows taking turns" if args.interleave else "")
    )
    print(header, flush=True)
    measured_on = {"model": args.model, "epochs": args.epochs, "environment": environment()}
    wanted = [part for part in (args.rows or "").split(",") if part]
    chosen = {
        f"{section} | {row.name}": (section, row)
        for section in sections
        for row in SECTIONS[section]
        if not wanted or any(part in row.name for part in wanted)
    }
    rows: list[dict] = []

    def keep(runs: dict[str, list[dict]]) -> None:  # the tables as they stand, after every row or round
        rows[:] = [row_result(*chosen[label], done, measured_on) for label, done in runs.items() if done]
        write_tables(out, header, rows)

    runners = {label: row_runner(*key, args, data, out) for label, key in chosen.items()}
    if args.interleave:
        rounds(runners, args.repeats, keep)
    else:  # row by row
        finished: dict[str, list[dict]] = {}
        for label, run in runners.items():
            finished[label] = repeat(run, args.repeats, label)
            keep(finished)
    print("\n" + (out / "bench.md").read_text())
    return 0 if all(r["status"] == "completed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
