"""scripts/bench.py without GPUs: a row keeps each run's images/s, and --merge --pool makes the
rows of several benches (a lease's calls) one row over all their runs; what
scripts/bench_sweep_launchers.py reads of a sweep's cost around its jobs."""

from __future__ import annotations

import csv
import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import bench  # noqa: E402 - a development script, not a package module
import bench_sweep_launchers  # noqa: E402


def run(rate: float) -> dict:
    return {"status": "completed", "img_per_s": rate, "peak_mem_mb": 836.0, "data_wait_frac": 0.07}


H100 = {"model": "fastcnn", "epochs": 3, "environment": "NVIDIA H100 80GB HBM3, torch 2.11.0, 2026-11-25"}


def bench_csv(path, rows: dict[str, list[float]], measured_on: dict = H100, settings: str | None = None):
    path.parent.mkdir(parents=True)
    results = [
        bench.row_result("tuned", bench.Row(name, [settings or name]), [run(r) for r in rates], measured_on)
        for name, rates in rows.items()
    ]
    bench.write_tables(path.parent, "header", results)
    return path


def test_a_row_keeps_each_runs_images_per_second(tmp_path):
    path = bench_csv(tmp_path / "a" / "bench.csv", {"perf=fast": [167300, 147386, 185687]})
    [row] = csv.DictReader(path.read_text().splitlines())
    assert row["img_per_s_each"] == "167300 147386 185687"
    assert float(row["img_per_s"]) == 167300


def test_pooling_two_calls_gives_one_row_over_all_their_runs(tmp_path, capsys):
    first = bench_csv(
        tmp_path / "a" / "bench.csv", {"perf=fast": [100, 300, 200], "perf=tuned": [150, 250, 50]}
    )
    second = bench_csv(tmp_path / "b" / "bench.csv", {"perf=fast": [400, 500], "perf=tuned": [600, 700]})

    assert bench.main(["--merge", str(first), str(second), "--pool"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| perf=")]
    assert lines == [
        "| perf=fast | perf=fast | 5 | 300 | 100-500 | 1.00x | 836 | 7.0% |",
        "| perf=tuned | perf=tuned | 5 | 250 | 50-700 | 0.83x | 836 | 7.0% |",
    ]

    assert bench.main(["--merge", str(first), str(second)]) == 0  # without --pool: each call's row
    assert len([line for line in capsys.readouterr().out.splitlines() if line.startswith("| perf=fast")]) == 2


def test_pool_without_merge_or_a_missing_table_is_one_line(tmp_path, capsys):
    assert bench.main(["--pool"]) == 2
    assert capsys.readouterr().err == "bench: --pool goes with --merge BENCH_CSV ... (the tables to pool)\n"
    assert bench.main(["--merge", str(tmp_path / "none.csv"), "--pool"]) == 2
    assert capsys.readouterr().err == f"bench: no such bench.csv: {tmp_path / 'none.csv'}\n"


def test_rows_of_other_settings_or_another_gpu_are_not_pooled(tmp_path, capsys):
    tuned = {"perf=tuned": [100, 200, 300]}
    first = bench_csv(tmp_path / "a" / "bench.csv", tuned)
    other_preset = bench_csv(tmp_path / "b" / "bench.csv", tuned, settings="--config-dir=b")
    h200 = bench_csv(tmp_path / "c" / "bench.csv", tuned, {**H100, "environment": "NVIDIA H200"})
    assert bench.main(["--merge", str(first), str(other_preset), str(h200), "--pool"]) == 0
    lines = capsys.readouterr().out.splitlines()
    runs = [line.split(" | ")[2] for line in lines if line.startswith("| perf=")]
    assert runs == ["3", "3", "3"]  # three rows, none pooled


def test_a_sweeps_cost_before_and_after_its_jobs_comes_from_their_records():
    """The first job's set-up began at its record's time less its wall_s plus its startup_s; the
    sweep went on after its last record for the rest of its wall time."""
    jobs = [
        {"written_at_s": 18.0, "wall_s": 9.7, "startup_s": 1.4},  # a worker's first job: 8.3 + 1.4
        {"written_at_s": 25.5, "wall_s": 7.0, "startup_s": 0.1},  # a later job
        {"status": "failed"},  # no timing: left out
    ]
    first, after = bench_sweep_launchers.sweep_edges({"wall_s": 26.0, "jobs": jobs})
    assert (round(first, 2), round(after, 2)) == (9.7, 0.5)
    assert bench_sweep_launchers.sweep_edges({"wall_s": 3.0, "jobs": [{"status": "failed"}]}) == (None, None)


def test_the_sweeps_path_is_left_as_it_is_where_the_checkout_is_on_it():
    """A served sweep is forked from a server only where its PYTHONPATH is the server's: the
    bench adds this checkout to the path only where it is not on it already."""
    here = str(REPO)
    assert bench_sweep_launchers.repo_on_path(f"{here}:/site") == f"{here}:/site"
    assert bench_sweep_launchers.repo_on_path(f"/site:{here}/") == f"/site:{here}/"
    assert bench_sweep_launchers.repo_on_path("/site") == f"{here}:/site"
    assert bench_sweep_launchers.repo_on_path("") == here
