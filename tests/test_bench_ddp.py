"""scripts/bench_ddp.py without GPUs: its tables and the probe's arithmetic on given timings,
and its one-line refusal where there is no CUDA."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO, cli_environment

sys.path.insert(0, str(REPO / "scripts"))
import bench_ddp  # noqa: E402 - a script beside bench.py, which it imports


def result(row: str, group: str, gpus: int, runs: list[float]) -> dict:
    return {
        "row": row,
        "group": group,
        "gpus": gpus,
        "runs": len(runs),
        "status": "completed",
        "img_per_s": sorted(runs)[len(runs) // 2],
        "min_img_per_s": min(runs),
        "max_img_per_s": max(runs),
    }


def test_scaling_table_shows_median_spread_and_per_gpu_efficiency():
    assert [gpus for _, gpus, _ in bench_ddp.scaling_rows(2)] == [1, 2, 1, 2]
    together = bench_ddp.dataparallel_rows(2)[0][2]
    assert "data_parallel=true" in together.trainer and "batch_size=1024" in together.trainer
    results = [
        result("gpu, 1 GPU", "gpu", 1, [80_000, 82_000, 81_000]),
        result("gpu, 2 GPUs", "gpu", 2, [150_000, 140_000, 146_000]),
        result("DataParallel, 2 GPUs", "compile=false", 2, [50_000, 52_000, 51_000]),
        result("DDP, 2 GPUs", "compile=false", 2, [102_000, 100_000, 101_000]),
    ]
    table = "\n".join(bench_ddp.scaling_table(results))
    assert "| gpu, 2 GPUs | 2 | 3 | 146,000 | 140,000-150,000 | 90.1% | completed |" in table
    assert "| DataParallel, 2 GPUs | 2 | 3 | 51,000 | 50,000-52,000 |  | completed |" in table
    assert "DDP / DataParallel (compile off, same GPUs): 1.98x" in table


def test_probe_arithmetic_on_given_timings():
    # 44.7 MB in 1 ms between 2 GPUs: each link carries the full buffer once, 44.7 GB/s
    assert bench_ddp.bus_bandwidth(RESNET18 := 4 * bench_ddp.RESNET18_PARAMETERS, 1e-3, 2) == pytest.approx(
        RESNET18 / 1e6
    )
    assert bench_ddp.bus_bandwidth(8e9, 1.0, 8) == pytest.approx(14.0)  # 8 GB x 2 x 7/8
    assert bench_ddp.exposed_share(0.010, 0.008) == pytest.approx(0.2)
    assert bench_ddp.exposed_share(0.008, 0.0081) == 0.0  # noise never makes a negative share
    ticks, calls = iter([10.0, 10.5]), []
    seconds = bench_ddp.seconds_per_call(
        lambda: calls.append(1), lambda: None, 3, 5, clock=lambda: next(ticks)
    )
    assert (seconds, len(calls)) == (0.1, 8)
    table = "\n".join(
        bench_ddp.probe_table(
            {"world_size": 2, "bucket_mb": 44, "all_reduce_s": 1e-3, "step_s": 0.010, "no_sync_step_s": 0.008}
        )
    )
    assert "| communication probe, 2 GPUs (NCCL), DDP buckets of 44 MB | value |" in table
    assert "| bus bandwidth | 44.7 GB/s |" in table
    assert "| all-reduce time / step time (if none were hidden) | 10.0% |" in table
    assert "| communication not hidden behind compute | 20.0% of the step |" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_without_cuda_it_stops_with_one_line(capsys):
    assert bench_ddp.main(["--repeats", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "bench_ddp: needs 2 or more CUDA GPUs on this host (found: no CUDA)\n"


def test_row_groups_split_the_bench_and_keep_each_rows_reference():
    names = [row.name for _, _, row in bench_ddp.selected_rows(["toggles"], 2, ["bucket_cap"])]
    assert names[0] == "gpu loader (perf=fast), 1 GPU, 512/GPU"  # what the kept rows are measured against
    assert len(names) == 3 and all("ddp_bucket_cap_mb=25" in name for name in names[1:])
    both = bench_ddp.selected_rows(["scaling", "toggles"], 2, [])
    assert len(both) == len({row.name for _, _, row in both}) == 4 + len(bench_ddp.TOGGLES)
    assert [row.name for _, _, row in bench_ddp.selected_rows(["dataparallel"], 2, [])] == [
        "DataParallel, 2 GPUs",
        "DDP, 2 GPUs",
    ]


def test_per_gpu_batches_give_each_batch_its_own_one_gpu_reference():
    rows = bench_ddp.selected_rows(["scaling"], 2, ["gpu loader"], [256, 512])
    assert [(group, gpus, row.trainer[-1]) for group, gpus, row in rows] == [
        ("gpu loader (perf=fast), 256/GPU", 1, "batch_size=256"),
        ("gpu loader (perf=fast), 256/GPU", 2, "batch_size=256"),
        ("gpu loader (perf=fast), 512/GPU", 1, "batch_size=512"),
        ("gpu loader (perf=fast), 512/GPU", 2, "batch_size=512"),
    ]


def test_an_unknown_group_is_one_line(capsys):
    assert bench_ddp.main(["--groups", "probe,scaleing"]) == 2
    assert capsys.readouterr().err == (
        "bench_ddp: unknown groups ['scaleing']: choose from probe, scaling, step_graph, "
        "dataparallel, toggles, peer\n"
    )


def test_the_probe_resolves_auto_buckets_without_a_data_folder():
    from trainer.config import ModelConfig
    from trainer.models import build_model

    model = build_model(ModelConfig(), num_classes=10)  # ResNet-18: a 42.6 MiB fp32 gradient
    assert bench_ddp.probe_bucket_mb(None, model) == 44.0
    assert bench_ddp.probe_bucket_mb(25.0, model) == 25.0


def test_the_peer_group_runs_the_hand_written_loop_on_one_gpu_and_data_parallel_on_all():
    rows = bench_ddp.selected_rows(["scaling", "peer"], 2, ["gpu loader", "hand-written"], [256])
    peers = {row.name: row for group, _, row in rows if group.startswith("hand-written")}
    assert peers["hand-written, 1 GPU, 256/GPU"].handwritten == ["--loader", "gpu", "--batch-size", "256"]
    two = peers["hand-written DDP, 2 GPUs, 256/GPU"].handwritten
    assert two == ["--loader", "gpu", "--gpus", "2", "--batch-size", "256"]
    trainer = [row.name for group, _, row in rows if not group.startswith("hand-written")]
    assert trainer == ["gpu loader (perf=fast), 1 GPU, 256/GPU", "gpu loader (perf=fast), 2 GPUs, 256/GPU"]


def test_the_hand_written_ddp_peer_trains_on_two_ranks_and_counts_both(tmp_path):
    """On the CPU (gloo): 512 images, 256 a rank, 8 steps of 32 each per epoch."""
    command = [sys.executable, str(REPO / "scripts" / "handwritten_loop.py"), "--gpus", "2", "--model", "cnn"]
    command += ["--compile-mode", "none", "--train-size", "512", "--batch-size", "32", "--epochs", "1"]
    done = subprocess.run(
        [*command, "--out", str(tmp_path)],
        env=cli_environment({"CUDA_VISIBLE_DEVICES": ""}),  # gloo ranks on the CPU, GPUs or not
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    [epoch] = metrics["history"]
    assert metrics["world_size"] == 2
    assert epoch["img_per_s"] == pytest.approx(8 * 32 * 2 / epoch["epoch_s"])
