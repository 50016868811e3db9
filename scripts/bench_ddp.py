"""DDP scaling and accuracy on one multi-GPU host.

    python scripts/bench_ddp.py                     # scaling on 1, 2, 4, ... GPUs (as many as present)
    python scripts/bench_ddp.py --accuracy-root /path/to/cifar10-subset   # + DDP vs 1-GPU accuracy

Scaling: ResNet-18, 512 images per GPU, amp bf16 + channels_last, with the GPU-resident
loader and with the torch DataLoader (8 workers per process, pinned, non-blocking), on
CIFAR-shaped synthetic data (50,000 images). Images/s is the median of the epochs after
the first; per-GPU efficiency = images/s on N GPUs / (N x images/s on 1 GPU).

Accuracy: the same global batch (512) as 1 GPU x 512 and N GPUs x 512/N on a real-image
folder, two seeds each, so the difference can be read against seed noise.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from datetime import datetime
from pathlib import Path

import torch
from bench import SYNTHETIC, Row, environment, fmt, run_once

LOADERS = {
    "gpu": ["data.loader=gpu"],
    "torch": ["num_workers=8", "persistent_workers=true", "pin_memory=true", "non_blocking=true"],
}
SETTINGS = ["amp=true", "amp_dtype=bf16", "channels_last=true", "batch_size=512"]


def gpu_counts(available: int) -> list[int]:
    counts, n = [], 1
    while n <= available:
        counts.append(n)
        n *= 2
    return counts


def scaling(out: Path, epochs: int, timeout_s: float) -> list[str]:
    lines = [
        "| loader | GPUs | images/s | per-GPU efficiency | status |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for loader, overrides in LOADERS.items():
        single = None
        for count in gpu_counts(torch.cuda.device_count()):
            ddp = ["ddp=true", f"devices={count}"] if count > 1 else []
            name = f"{loader}-{count}gpu"
            row = run_once(
                Row(name, [*SETTINGS, *overrides, *ddp]), SYNTHETIC, "resnet18", epochs, out / name, timeout_s
            )
            rate = row.get("img_per_s")
            single = rate if count == 1 else single
            efficiency = rate / (count * single) if rate and single else None
            lines.append(
                f"| {loader} | {count} | {fmt(rate, ',.0f')} | {fmt(efficiency, '.1%')} | {row['status']} |"
            )
            print(lines[-1], flush=True)
    return lines


def accuracy(out: Path, root: Path, epochs: int, timeout_s: float) -> list[str]:
    count = torch.cuda.device_count()
    common = [
        "data=imagefolder",
        f"data.root={root}",
        "data.loader=gpu",
        "amp=true",
        "amp_dtype=bf16",
        "channels_last=true",
        "optim.label_smoothing=0.1",
    ]
    lines = ["| run | global batch | test accuracy (seeds 0, 1) | mean |", "| --- | ---: | --- | ---: |"]
    for name, overrides in (
        ("1 GPU x 512", ["batch_size=512"]),
        (
            f"{count} GPUs x {512 // count}",
            ["batch_size=" + str(512 // count), "ddp=true", f"devices={count}"],
        ),
    ):
        accuracies = []
        for seed in (0, 1):
            name = f"acc-{len(overrides)}-{seed}"
            row = run_once(
                Row(name, [*overrides, f"seed={seed}"]), common, "resnet18", epochs, out / name, timeout_s
            )
            accuracies.append(row.get("test_acc"))
        shown = ", ".join(fmt(a, ".3f") for a in accuracies)
        mean = statistics.mean(accuracies) if None not in accuracies else None
        lines.append(f"| {name} | 512 | {shown} | {fmt(mean, '.3f')} |")
        print(lines[-1], flush=True)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=3, help="scaling runs; the first is warm-up")
    parser.add_argument("--accuracy-root", type=Path, help="class-folder dataset for the accuracy check")
    parser.add_argument("--accuracy-epochs", type=int, default=15)
    parser.add_argument("--skip-scaling", action="store_true")
    parser.add_argument("--row-timeout", type=float, default=180)
    parser.add_argument(
        "--out", type=Path, default=Path("outputs") / "bench" / f"ddp-{datetime.now():%Y-%m-%d_%H-%M-%S}"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_ddp: needs CUDA GPUs", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    text = [f"ResNet-18, {environment()}, {torch.cuda.device_count()} GPU(s)", ""]
    if not args.skip_scaling:
        text += scaling(args.out, args.epochs, args.row_timeout) + [""]
    if args.accuracy_root:
        text += accuracy(args.out, args.accuracy_root, args.accuracy_epochs, args.row_timeout)
    (args.out / "bench_ddp.md").write_text("\n".join(text) + "\n")
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
