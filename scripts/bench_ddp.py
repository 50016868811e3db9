"""DDP scaling on one multi-GPU host, with its spread and where the time goes.

    python scripts/bench_ddp.py                          # probe, scaling and DataParallel groups
    python scripts/bench_ddp.py --repeats 5 --epochs 3   # more runs per row
    python scripts/bench_ddp.py --groups toggles --rows bucket,view   # part of one group
    python scripts/bench_ddp.py --accuracy-root /path/to/cifar10-subset   # + DDP vs 1-GPU accuracy
    python scripts/bench_ddp.py --groups scaling --per-gpu-batches 256,512 --interleave

Row groups (--groups, each a table of its own, so that a bench too long for one sitting is
run group by group, e.g. `probe,scaling` then `dataparallel,toggles --rows bucket,view` then
`toggles --rows hook,static`, each about 8 minutes at 3 repeats on 2 GPUs):

  probe         the communication probe, with torch's 25 MB buckets and with the default
                ddp_bucket_cap_mb=auto (the whole gradient in one bucket)
  scaling       perf=fast, and perf=fast data.loader=torch, on 1 and N GPUs
  step_graph    the scaling rows with step_graph=true
  dataparallel  DataParallel beside DDP at the same settings (compile off)
  toggles       each ddp_* toggle changed from perf=fast's defaults on N GPUs, beside the
                1-GPU row it is measured against
  peer          the hand-written peer (scripts/handwritten_loop.py --loader gpu) on 1 GPU and,
                data-parallel as PyTorch's documentation writes it, on N GPUs
                (torch.compile(DistributedDataParallel(model)), one process per GPU): with
                `--groups scaling,peer --rows "gpu loader,hand-written"` the trainer's rows
                and the peer's in one table

Scaling: ResNet-18, 512 images per GPU, `perf=fast` with the GPU-resident loader and with the
torch DataLoader (`data.loader=torch`), on 1 and N GPUs (N = every GPU here), on CIFAR-shaped
synthetic data (50,000 images). Every row runs --repeats times, each run in its own process;
a run's images/s is the median of its epochs after the first, the row shows the median of the
runs and their spread (min-max). Per-GPU efficiency = images/s on N GPUs / (N x the same
loader's images/s on 1 GPU). DataParallel: the same model in one process over N GPUs
(compile off: DataParallel re-replicates the module every step), beside DDP at the same settings.

Communication probe (one NCCL group of N processes): the bus bandwidth of an all-reduce of a
ResNet-18-sized gradient (11.2M fp32 values), and the share of a DDP training step spent on
communication that compute does not hide: the step time with DDP against the same step under
no_sync() (no all-reduce), eager bf16 channels_last, 512 images per GPU.

Accuracy: the same global batch (512) as 1 GPU x 512 and N GPUs x 512/N on a real-image
folder, two seeds each, so the difference can be read against seed noise.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

from bench import (  # bench puts this checkout's trainer first
    REPO,
    SYNTHETIC,
    Row,
    row_result,
    row_runner,
    run_once,
    run_row,
)

from trainer.trials import environment, fmt, rounds, spread

RESNET18_PARAMETERS = 11_173_962  # ResNet-18 with the CIFAR stem and 10 classes
PROBE_BATCH = 512
LOADERS = {
    "gpu loader (perf=fast)": ["perf=fast"],
    "torch DataLoader (perf=fast data.loader=torch)": ["perf=fast", "data.loader=torch"],
}
STEP_GRAPH = ["step_graph=true"]
NO_COMPILE = ["perf=fast", "compile=false"]
# Each changed from perf=fast's DDP defaults (ddp_bucket_cap_mb=auto, bucket views on).
TOGGLES = {
    "ddp_bucket_cap_mb=25 (torch's)": ["ddp_bucket_cap_mb=25"],
    "ddp_bucket_cap_mb=25 ddp_gradient_as_bucket_view=false (torch's)": [
        "ddp_bucket_cap_mb=25",
        "ddp_gradient_as_bucket_view=false",
    ],
    "ddp_gradient_as_bucket_view=false": ["ddp_gradient_as_bucket_view=false"],
    "ddp_comm_hook=bf16": ["ddp_comm_hook=bf16"],
    "ddp_comm_hook=fp16": ["ddp_comm_hook=fp16"],
    "ddp_comm_hook=powersgd": ["ddp_comm_hook=powersgd"],
    "ddp_static_graph=true": ["ddp_static_graph=true"],
    "ddp_sync=wrapper (DistributedDataParallel)": ["ddp_sync=wrapper"],
}
GROUPS = ("probe", "scaling", "step_graph", "dataparallel", "toggles", "peer")
PROBE_BUCKETS_MB = (25.0, None)  # torch's default, then auto: the whole gradient in one bucket


def scaling_rows(gpus: int) -> list[tuple[str, int, Row]]:
    """(group, GPUs, row): each loader on 1 and `gpus` GPUs."""
    rows = []
    for loader, overrides in LOADERS.items():
        rows.append((loader, 1, Row(f"{loader}, 1 GPU", overrides)))
        ddp = ["ddp=true", f"devices={gpus}"]
        rows.append((loader, gpus, Row(f"{loader}, {gpus} GPUs", [*overrides, *ddp])))
    return rows


def step_graph_rows(gpus: int) -> list[tuple[str, int, Row]]:
    """The scaling rows with the step captured as one CUDA graph (step_graph=true)."""
    return [
        (
            f"{group}, step graph",
            count,
            Row(row.name.replace(")", " step_graph=true)", 1), [*row.trainer, *STEP_GRAPH]),
        )
        for group, count, row in scaling_rows(gpus)
    ]


def dataparallel_rows(gpus: int) -> list[tuple[str, int, Row]]:
    """DataParallel beside DDP, compile off (DataParallel re-replicates the module every step)."""
    together = ["data_parallel=true", f"devices={gpus}", f"batch_size={PROBE_BATCH * gpus}"]
    return [
        ("compile=false", gpus, Row(f"DataParallel, {gpus} GPUs", [*NO_COMPILE, *together])),
        ("compile=false", gpus, Row(f"DDP, {gpus} GPUs", [*NO_COMPILE, "ddp=true", f"devices={gpus}"])),
    ]


def toggle_rows(gpus: int) -> list[tuple[str, int, Row]]:
    """Each toggle changed in DDP perf=fast on `gpus` GPUs, after the gpu loader's 1-GPU row that
    their efficiency is measured against."""
    group, overrides = next(iter(LOADERS.items()))
    ddp = [*overrides, "ddp=true", f"devices={gpus}"]
    return [
        (group, 1, Row(f"{group}, 1 GPU", overrides)),
        *((group, gpus, Row(f"{gpus} GPUs, {name}", [*ddp, *extra])) for name, extra in TOGGLES.items()),
    ]


def peer_rows(gpus: int) -> list[tuple[str, int, Row]]:
    """The hand-written loop on 1 GPU and data-parallel on `gpus`, the trainer's peer."""
    group, loop = "hand-written (torch.compile(DistributedDataParallel(model)))", ["--loader", "gpu"]
    return [
        (group, 1, Row("hand-written, 1 GPU", handwritten=loop)),
        (group, gpus, Row(f"hand-written DDP, {gpus} GPUs", handwritten=[*loop, "--gpus", str(gpus)])),
    ]


ROW_GROUPS = {
    "scaling": scaling_rows,
    "step_graph": step_graph_rows,
    "dataparallel": dataparallel_rows,
    "toggles": toggle_rows,
    "peer": peer_rows,
}
PER_GPU_GROUPS = (
    "scaling",
    "step_graph",
    "toggles",
    "peer",
)  # DataParallel's rows set their own (whole-host) batch


def at_batch(rows: list[tuple[str, int, Row]], batch: int) -> list[tuple[str, int, Row]]:
    """The rows at `batch` images per GPU, each compared with the 1-GPU row of that batch."""

    def at(row: Row) -> Row:
        if row.handwritten is not None:
            return Row(f"{row.name}, {batch}/GPU", handwritten=[*row.handwritten, "--batch-size", str(batch)])
        return Row(f"{row.name}, {batch}/GPU", [*row.trainer, f"batch_size={batch}"])

    return [(f"{group}, {batch}/GPU", gpus, at(row)) for group, gpus, row in rows]


def group_rows(group: str, gpus: int, batches: list[int]) -> list[tuple[str, int, Row]]:
    rows = ROW_GROUPS[group](gpus)
    if group not in PER_GPU_GROUPS:
        return rows
    return [row for batch in batches for row in at_batch(rows, batch)]


def selected_rows(
    groups: list[str], gpus: int, wanted: list[str], batches: list[int] | None = None
) -> list[tuple[str, int, Row]]:
    """The groups' rows (the per-GPU ones at each of `batches` images per GPU, perf=fast's 512
    by default) whose names contain one of `wanted` (all when empty); a 1-GPU row that a kept
    row is measured against stays."""
    batches = batches or [PROBE_BATCH]
    named = {
        row[2].name: row
        for group in groups
        if group in ROW_GROUPS
        for row in group_rows(group, gpus, batches)
    }
    rows = list(named.values())  # a 1-GPU row two groups share runs once
    kept = [row for row in rows if not wanted or any(part in row[2].name for part in wanted)]
    references = {group for group, count, _ in kept if count > 1}
    single = [row for row in rows if row[1] == 1 and row[0] in references and row not in kept]
    return [row for row in rows if row in kept or row in single]


def efficiencies(results: list[dict]) -> list[float | None]:
    """Per-GPU efficiency of each row against its group's 1-GPU row (None where there is none)."""
    single = {r["group"]: r.get("img_per_s") for r in results if r["gpus"] == 1}
    out = []
    for r in results:
        reference, rate = single.get(r["group"]), r.get("img_per_s")
        out.append(rate / (r["gpus"] * reference) if rate and reference else None)
    return out


def scaling_table(results: list[dict]) -> list[str]:
    lines = [
        "| row | GPUs | runs | images/s (median) | spread (min-max) | per-GPU efficiency | status |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r, efficiency in zip(results, efficiencies(results)):
        lines.append(
            f"| {r['row']} | {r['gpus']} | {r['runs']} | {fmt(r.get('img_per_s'), ',.0f')} | {spread(r)} | "
            f"{fmt(efficiency, '.1%')} | {r['status']} |"
        )
    by_name = {r["row"]: r.get("img_per_s") for r in results}
    pairs = [(n, n.replace("DataParallel", "DDP")) for n in by_name if n.startswith("DataParallel")]
    for together, ddp in pairs:
        if by_name.get(together) and by_name.get(ddp):
            lines.append(
                f"\nDDP / DataParallel (compile off, same GPUs): {by_name[ddp] / by_name[together]:.2f}x"
            )
    return lines


# ------------------------------------------------------------------ communication probe


def bus_bandwidth(num_bytes: int, seconds: float, world_size: int) -> float:
    """GB/s an all-reduce moves over the slowest link (NCCL's busbw: algbw x 2(n-1)/n)."""
    return num_bytes / seconds * 2 * (world_size - 1) / world_size / 1e9


def exposed_share(step_s: float, no_sync_step_s: float) -> float:
    """The part of a DDP step spent on communication that compute does not hide."""
    return max(0.0, step_s - no_sync_step_s) / step_s


def seconds_per_call(
    call: Callable[[], None],
    synchronize: Callable[[], None],
    warmup: int,
    iterations: int,
    clock=time.perf_counter,
) -> float:
    """Mean wall time of `call` after `warmup` untimed calls, synchronized before and after."""
    for _ in range(warmup):
        call()
    synchronize()
    started = clock()
    for _ in range(iterations):
        call()
    synchronize()
    return (clock() - started) / iterations


def probe_bucket_mb(bucket_cap_mb: float | None, model) -> float:
    """`bucket_cap_mb`, or for None what ddp_bucket_cap_mb=auto resolves to for `model`."""
    from trainer.config import DataConfig, DataSource, TrainConfig
    from trainer.perf import bucket_cap_mb as resolved_bucket_mb

    auto = TrainConfig(data=DataConfig(source=DataSource.synthetic), ddp_bucket_cap_mb="auto")
    return bucket_cap_mb or resolved_bucket_mb(auto, model)


def probe_rank(ranks, warmup: int, iterations: int, bucket_cap_mb: float | None) -> dict:
    """In each launched rank: the all-reduce and the DDP step with and without its all-reduce,
    in buckets of `bucket_cap_mb` (None: ddp_bucket_cap_mb=auto, as the trainer resolves it)."""
    import torch
    from torch import nn

    from trainer import distributed
    from trainer.config import ModelConfig
    from trainer.models import build_model

    device = torch.device("cuda", ranks.local_rank)
    distributed.init_process_group("nccl", ranks, device)
    try:
        gradient = torch.zeros(RESNET18_PARAMETERS, device=device)
        all_reduce_s = seconds_per_call(
            lambda: torch.distributed.all_reduce(gradient), torch.cuda.synchronize, warmup, iterations
        )
        model = build_model(ModelConfig(), num_classes=10).to(device, memory_format=torch.channels_last)
        bucket_mb = probe_bucket_mb(bucket_cap_mb, model)
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index], bucket_cap_mb=bucket_mb)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        images = torch.randn(PROBE_BATCH, 3, 32, 32, device=device).to(memory_format=torch.channels_last)
        labels = torch.randint(0, 10, (PROBE_BATCH,), device=device)

        def step() -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        def step_without_sync() -> None:
            with model.no_sync():
                step()

        step_s = seconds_per_call(step, torch.cuda.synchronize, warmup, iterations)
        no_sync_s = seconds_per_call(step_without_sync, torch.cuda.synchronize, warmup, iterations)
        return {
            "world_size": ranks.world_size,
            "bucket_mb": bucket_mb,
            "all_reduce_s": all_reduce_s,
            "step_s": step_s,
            "no_sync_step_s": no_sync_s,
        }
    finally:
        distributed.destroy_process_group()


def probe_table(probe: dict) -> list[str]:
    n, megabytes = probe["world_size"], RESNET18_PARAMETERS * 4 / 1e6
    bandwidth = bus_bandwidth(RESNET18_PARAMETERS * 4, probe["all_reduce_s"], n)
    exposed = exposed_share(probe["step_s"], probe["no_sync_step_s"])
    serial = probe["all_reduce_s"] / probe["step_s"]
    all_reduce_ms = 1e3 * probe["all_reduce_s"]
    return [
        f"| communication probe, {n} GPUs (NCCL), DDP buckets of {probe['bucket_mb']:g} MB | value |",
        "| --- | ---: |",
        f"| all-reduce of {megabytes:.1f} MB (ResNet-18's fp32 gradient) | {all_reduce_ms:.2f} ms |",
        f"| bus bandwidth | {bandwidth:.1f} GB/s |",
        f"| DDP step, eager bf16, {PROBE_BATCH} images/GPU | {1e3 * probe['step_s']:.2f} ms |",
        f"| same step under no_sync (no all-reduce) | {1e3 * probe['no_sync_step_s']:.2f} ms |",
        f"| all-reduce time / step time (if none were hidden) | {serial:.1%} |",
        f"| communication not hidden behind compute | {exposed:.1%} of the step |",
    ]


# ------------------------------------------------------------------ sections


def scaling(out: Path, args, rows: list[tuple[str, int, Row]]) -> list[str]:
    settings = SimpleNamespace(
        repeats=args.repeats, model="resnet18", epochs=args.epochs, row_timeout=args.row_timeout
    )
    if args.interleave:
        runners = {row.name: row_runner("ddp", row, settings, SYNTHETIC, out) for _, _, row in rows}
        runs = rounds(runners, args.repeats)
        measured = [row_result("ddp", row, runs[row.name]) for _, _, row in rows]
    else:
        measured = [run_row("ddp", row, settings, SYNTHETIC, out) for _, _, row in rows]
    results = [{**result, "group": group, "gpus": gpus} for result, (group, gpus, _) in zip(measured, rows)]
    return scaling_table(results)


def accuracy(out: Path, root: Path, epochs: int, timeout_s: float, count: int) -> list[str]:
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
            slug = f"acc-{len(overrides)}-{seed}"
            row = run_once(
                Row(slug, [*overrides, f"seed={seed}"]), common, "resnet18", epochs, out / slug, timeout_s
            )
            accuracies.append(row.get("test_acc"))
        shown = ", ".join(fmt(a, ".3f") for a in accuracies)
        mean = statistics.mean(accuracies) if None not in accuracies else None
        lines.append(f"| {name} | 512 | {shown} | {fmt(mean, '.3f')} |")
        print(lines[-1], flush=True)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=3, help="per run; the first is warm-up")
    parser.add_argument("--repeats", type=int, default=3, help="runs per row (median and spread)")
    parser.add_argument(
        "--groups", default="probe,scaling,dataparallel", help=f"comma-separated: {', '.join(GROUPS)}"
    )
    parser.add_argument("--rows", default=None, help="only rows whose name contains one of these (a,b)")
    parser.add_argument(
        "--per-gpu-batches",
        default=str(PROBE_BATCH),
        help="images per GPU of the scaling and toggle rows (a,b)",
    )
    parser.add_argument(
        "--interleave", action="store_true", help="the rows take turns: run 1 of each, then run 2, ..."
    )
    parser.add_argument("--probe-iterations", type=int, default=20, help="timed; after 5 warm-up")
    parser.add_argument("--accuracy-root", type=Path, help="class-folder dataset for the accuracy check")
    parser.add_argument("--accuracy-epochs", type=int, default=15)
    parser.add_argument("--row-timeout", type=float, default=300)
    parser.add_argument(
        "--set", default="", help="overrides added to every row, space-separated (e.g. num_workers=7)"
    )
    parser.add_argument("--out", type=Path, default=None, help="folder for runs, logs and bench_ddp.md")
    args = parser.parse_args(argv)
    groups = [group for group in args.groups.split(",") if group]
    unknown = [group for group in groups if group not in GROUPS]
    if unknown:
        print(f"bench_ddp: unknown groups {unknown}: choose from {', '.join(GROUPS)}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        found = torch.cuda.device_count() if torch.cuda.is_available() else "no CUDA"
        print(f"bench_ddp: needs 2 or more CUDA GPUs on this host (found: {found})", file=sys.stderr)
        return 2
    if args.epochs < 2 or args.repeats < 1:
        print(
            "bench_ddp: --epochs must be at least 2 (the first is warm-up), --repeats at least 1",
            file=sys.stderr,
        )
        return 2
    gpus = torch.cuda.device_count()
    out = args.out or REPO / "outputs" / "bench" / f"ddp-{datetime.now():%Y-%m-%d_%H-%M-%S}"
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    text = [
        f"ResNet-18, {environment()}, {gpus} GPUs; {args.epochs} epochs per run (median of the last "
        f"{args.epochs - 1}), {args.repeats} run(s) per row",
        "",
    ]
    if "probe" in groups:
        from trainer.distributed import launch

        for bucket_mb in PROBE_BUCKETS_MB:
            text += probe_table(launch(gpus, probe_rank, (5, args.probe_iterations, bucket_mb))) + [""]
        print("\n".join(text), flush=True)
    batches = [int(batch) for batch in args.per_gpu_batches.split(",") if batch]
    rows = selected_rows(groups, gpus, [part for part in (args.rows or "").split(",") if part], batches)
    if args.set:
        extra = args.set.split()
        rows = [
            (group, count, Row(f"{row.name} {args.set}", [*row.trainer, *extra]))
            for group, count, row in rows
        ]
    if rows:
        text += scaling(out, args, rows) + [""]
    if args.accuracy_root:
        text += accuracy(out, args.accuracy_root, args.accuracy_epochs, args.row_timeout, gpus) + [""]
    text.append(f"bench_ddp took {time.perf_counter() - started:.0f} s")
    (out / "bench_ddp.md").write_text("\n".join(text) + "\n")
    print("\n" + "\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
