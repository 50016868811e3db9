"""python -m trainer.report on real tiny sweeps (CPU): the table, the charts, the toggle summary,
failed and unfinished jobs, seed groups; and TensorBoard HParams for every job of a sweep."""

from __future__ import annotations

import contextlib
import csv
import json
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import (
    HANG_GUARD_S,
    SWEEP_SMALL,
    TOGGLE_SWEEP,
    cli_environment,
    compose_config,
    copy_sweep,
    job_number,
    read_metrics,
    run_folders,
    sweep,
    sweep_job,
)
from matplotlib.image import imread

from trainer import Trainer, tags
from trainer.job_names import job_place
from trainer.report import __main__ as report


@pytest.fixture(scope="module")
def seed_sweep(tmp_path_factory) -> Path:
    """Two seeds of a good learning rate, two of one that makes the loss NaN at step 2; one epoch."""
    folder = sweep(tmp_path_factory, "seeds", *SWEEP_SMALL, "seed=0,1", "optim.lr=0.05,1e30")
    assert len(run_folders(folder)) == 4
    return folder


LEAN = shutil.ignore_patterns("checkpoints", "report.*")  # a sweep's copy without what no test reads


def run_report(*args, capsys) -> tuple[int, str, str]:
    code = report.main([str(arg) for arg in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def read_csv(folder: Path) -> list[dict]:
    with (folder / "report.csv").open(newline="") as handle:
        return list(csv.DictReader(handle))


def markdown_rows(text: str, first_cell: str) -> list[list[str]]:
    """The cells of the markdown table rows whose first cell starts with first_cell."""
    rows = [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("|")
    ]
    return [row for row in rows if row[0].startswith(first_cell)]


def job_metrics(sweep_folder: Path) -> dict[str, dict]:
    return {job_number(job_place(job).name): read_metrics(job) for job in run_folders(sweep_folder)}


@contextlib.contextmanager
def tensorboard_server(logdir: Path, runs: int) -> Iterator[Callable[..., object]]:
    """A real TensorBoard on a free localhost port, serving logdir once it has loaded `runs`
    runs; yields api(path, body=None) -> its JSON answer (a POST when there is a body)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1"]
    command += ["--port", str(port), "--load_fast", "false", "--reload_interval", "1"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def api(path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", "X-XSRF-Protected": "1"}
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, headers=headers)
        with urllib.request.urlopen(request, timeout=30) as answer:
            return json.loads(answer.read())

    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while True:
            assert server.poll() is None, f"tensorboard exited: {server.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline, "tensorboard never served the runs"
            with contextlib.suppress(OSError):
                if len(api("/data/runs")) >= runs:
                    break
            time.sleep(0.5)
        yield api
    finally:
        server.kill()
        server.wait()


def test_tensorboard_serves_the_sweep_by_job_name_with_the_swept_hparams_first(toggle_sweep, tmp_path):
    """What `tensorboard --logdir` serves over a sweep and a weight-average run beside it."""
    logdir = tmp_path / "outputs"
    copy_sweep(toggle_sweep, logdir)  # as `python -m trainer -m ...` left outputs/
    ema_overrides = [*TOGGLE_SWEEP, "ema.enabled=true", "ema.update_every=1"]
    Trainer(compose_config(*ema_overrides, small=False), logdir / "ema", overrides=ema_overrides).fit()
    jobs = [job for job in run_folders(logdir) if job.name != "ema"]
    with tensorboard_server(logdir, 2 * (len(jobs) + 1)) as api:  # tb/ and schedule/ of each
        runs = api("/data/runs")
        experiment = api("/data/plugin/hparams/experiment", {"experimentName": ""})
        tags_by_run = api("/data/plugin/scalars/tags")
        columns = [{"hparam": info["name"]} for info in experiment["hparamInfos"]]
        columns += [{"metric": info["name"]} for info in experiment["metricInfos"]]
        statuses = ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"]
        query = {"experimentName": "", "allowedStatuses": statuses, "colParams": columns}
        groups = api("/data/plugin/hparams/session_groups", query | {"startIndex": 0, "sliceSize": 100})
        run = f"{jobs[-1].relative_to(logdir).as_posix()}/tb"
        accuracy = api(
            f"/data/plugin/scalars/scalars?run={urllib.parse.quote(run)}&tag={urllib.parse.quote(tags.TEST_ACC)}"
        )

    # the legend: each job by the values it was swept over, then the sweep's date and time and the
    # job's number
    swept = [(amp, layout) for amp in ("false", "true") for layout in ("false", "true")]  # Hydra's order
    stamp = f"{toggle_sweep.parent.name}_{toggle_sweep.name}"
    expected = [f"amp={a},channels_last={c}/{stamp}_{job}/tb" for job, (a, c) in enumerate(swept)]
    schedules = [run.replace("/tb", "/schedule") for run in [*expected, "ema/tb"]]  # the lr, apart
    assert sorted(runs) == sorted([*expected, "ema/tb", *schedules])
    # HParams: the swept keys first (TensorBoard ticks the first five), then the core and what the
    # command lines set; not the whole config
    infos = experiment["hparamInfos"]
    names = [info["name"] for info in infos]
    assert set(names[:2]) == {"amp", "channels_last"}
    assert [info["name"] for info in infos if info.get("differs")] == names[:2]
    assert {"model", "data", "epochs", "batch_size", "seed", "ema.enabled"} <= set(names)
    assert len(names) <= 16 and "optim.momentum" not in names
    by_run = {group["name"]: group["hparams"] for group in groups["sessionGroups"]}
    assert {by_run[f"{job.relative_to(logdir).as_posix()}/tb"]["batch_size"] for job in jobs} == {"32"}
    # metrics: the test accuracy first (ticked, and what parallel coordinates are coloured by),
    # the accuracies and losses in the first five, images/s the first after them; the same list
    # whichever run is read first; no one-point charts
    metrics = [info["name"]["tag"] for info in experiment["metricInfos"]]
    assert metrics[0] == tags.TEST_ACC
    assert metrics[:3] == [tags.TEST_ACC, tags.TEST_ACC_TTA, tags.TRAIN_ACC]
    assert {tags.TRAINED_TEST_ACC, tags.TEST_LOSS, tags.TRAIN_LOSS} <= set(metrics)
    assert (
        metrics.index(tags.TRAIN_LOSS)
        < metrics.index(tags.IMG_PER_S)
        == min(metrics.index(tag) for tag in metrics if tag.startswith("perf/"))
    )
    assert tags.LR not in metrics  # a setting, not a figure of how the run went
    # Time Series opens the first two groups: accuracy and loss
    groups_of_tags = sorted({tag.split("/")[0] for run_tags in tags_by_run.values() for tag in run_tags})
    assert groups_of_tags[:2] == ["accuracy", "loss"]
    assert set(tags_by_run["ema/tb"]) >= {tags.TEST_ACC, tags.TRAINED_TEST_ACC, tags.TRAINED_TEST_ACC_TTA}
    assert not {tags.TRAINED_TEST_ACC} & set(tags_by_run[expected[0]])
    assert not [tag for run_tags in tags_by_run.values() for tag in run_tags if tag.startswith("hparam")]
    # the x axis: images trained on (4 optimizer steps of 32 images), the last point metrics.json's
    last = read_metrics(jobs[-1])
    assert accuracy[-1][1] == last["steps"] * 32
    assert accuracy[-1][2] == pytest.approx(last["test_acc"], rel=1e-6)  # TensorBoard holds float32


def test_cli_writes_the_report_into_the_sweep_folder(toggle_sweep):
    result = subprocess.run(
        [sys.executable, "-m", "trainer.report", str(toggle_sweep)],
        env=cli_environment(),
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (toggle_sweep / "report.md").read_text().strip()
    rows = read_csv(toggle_sweep)
    assert len(rows) == 4
    assert {(row["amp"], row["channels_last"]) for row in rows} == {
        ("false", "false"),
        ("false", "true"),
        ("true", "false"),
        ("true", "true"),
    }
    assert [row["status"] for row in rows] == ["completed"] * 4
    assert (toggle_sweep / "speedup.png").is_file() and (toggle_sweep / "accuracy_vs_time.png").is_file()


def test_speedup_and_accuracy_change_are_relative_to_the_all_off_job(toggle_sweep, tmp_path, capsys):
    code, out, _ = run_report(toggle_sweep, "--out", tmp_path, capsys=capsys)
    assert code == 0
    rows, metrics = read_csv(tmp_path), job_metrics(toggle_sweep)
    [baseline] = [row for row in rows if row["baseline"] == "yes"]
    assert (baseline["amp"], baseline["channels_last"]) == ("false", "false")
    assert "every toggle off" in out
    base = metrics[baseline["job"]]
    for row in rows:
        job = metrics[row["job"]]
        assert f"amp={row['amp']}" in [override.lower() for override in job["overrides"]]
        assert float(row["img_per_s"]) == pytest.approx(job["img_per_s"])
        assert float(row["speedup"]) == pytest.approx(job["img_per_s"] / base["img_per_s"])
        assert float(row["test_acc_change"]) == pytest.approx(job["test_acc"] - base["test_acc"])
        assert row["n"] == "1" and row["img_per_s_std"] == ""


def test_charts_are_images_of_a_readable_size(toggle_sweep, tmp_path, capsys):
    assert run_report(toggle_sweep, "--out", tmp_path, capsys=capsys)[0] == 0
    for name in ("speedup.png", "accuracy_vs_time.png"):
        height, width = imread(tmp_path / name).shape[:2]
        assert width > 200 and height > 200, name


def test_factorial_summary_gives_each_toggles_mean_effect(toggle_sweep, tmp_path, capsys):
    code, out, _ = run_report(toggle_sweep, "--out", tmp_path, capsys=capsys)
    assert code == 0
    assert "## One toggle at a time" in out and out == (tmp_path / "report.md").read_text() + "\n"
    speed = {(row["amp"], row["channels_last"]): float(row["img_per_s"]) for row in read_csv(tmp_path)}
    amp_on = statistics.geometric_mean(
        [speed["true", "false"] / speed["false", "false"], speed["true", "true"] / speed["false", "true"]]
    )
    layout_on = statistics.geometric_mean(
        [speed["false", "true"] / speed["false", "false"], speed["true", "true"] / speed["true", "false"]]
    )
    [amp] = markdown_rows(out, "amp")
    [channels_last] = markdown_rows(out, "channels_last")
    assert amp[1] == f"{amp_on:.2f}×" and amp[3] == "2"
    assert channels_last[1] == f"{layout_on:.2f}×" and channels_last[3] == "2"


def test_a_diverged_job_is_reported_as_diverged(seed_sweep, tmp_path, capsys):
    code, out, _ = run_report(seed_sweep, "--out", tmp_path, capsys=capsys)
    assert code == 0
    rows = {row["optim.lr"]: row for row in read_csv(tmp_path)}
    assert set(rows) == {"0.05", "1e+30"}
    failed = rows["1e+30"]
    assert failed["status"] == "diverged" and failed["n"] == "0"
    assert failed["img_per_s"] == failed["speedup"] == failed["test_acc"] == ""
    assert "training loss became nan" in failed["error"]
    assert rows["0.05"]["status"] == "completed" and rows["0.05"]["baseline"] == "yes"
    assert "## Jobs that did not complete" in out
    assert out.count("diverged: training loss became nan") == 2


def test_jobs_differing_only_in_seed_share_a_row_with_mean_and_std(seed_sweep, tmp_path, capsys):
    code, out, _ = run_report(seed_sweep, "--out", tmp_path, capsys=capsys)
    assert code == 0
    [row] = [row for row in read_csv(tmp_path) if row["optim.lr"] == "0.05"]
    jobs = jobs_metrics = list(job_metrics(seed_sweep).values())
    speeds = [job["img_per_s"] for job in jobs if "optim.lr=0.05" in job["overrides"]]
    assert row["n"] == "2" and "seed" not in row
    assert float(row["img_per_s"]) == pytest.approx(statistics.fmean(speeds))
    assert float(row["img_per_s_std"]) == pytest.approx(statistics.stdev(speeds))
    [cells] = [cells for cells in markdown_rows(out, "") if "0.05" in cells]
    header = markdown_rows(out, "job")[0]
    assert cells[header.index("n")] == "2"
    assert "±" in cells[header.index("img/s")] and "±" in cells[header.index("test acc")]
    # one after another (the basic launcher): no job shared the host with another
    assert all(job["jobs_at_once"] is None for job in jobs_metrics) and "on this host's CPU" not in out


def test_each_row_says_where_its_wall_time_went(seed_sweep, tmp_path, capsys):
    """Start-up, set-up and compile beside the wall time, as each job's metrics.json has them:
    what a job cost besides training, the same figures as in its metrics.json."""
    code, out, _ = run_report(seed_sweep, "--out", tmp_path, capsys=capsys)
    assert code == 0
    header = markdown_rows(out, "job")[0]
    assert header.index("start-up") < header.index("set-up") < header.index("compile") < header.index("wall")
    [row] = [row for row in read_csv(tmp_path) if row["optim.lr"] == "0.05"]
    jobs = [job for job in job_metrics(seed_sweep).values() if "optim.lr=0.05" in job["overrides"]]
    for key in ("startup_s", "setup_s"):
        assert float(row[key]) == pytest.approx(statistics.fmean(job[key] for job in jobs))
        assert all(job[key] > 0 for job in jobs)


def test_unfinished_jobs_and_missing_metrics_never_break_the_report(toggle_sweep, tmp_path, capsys):
    sweep_copy = copy_sweep(toggle_sweep, tmp_path / "sweep", ignore=LEAN)
    (sweep_job(sweep_copy, 3) / "metrics.json").unlink()  # a job killed before it wrote anything
    interrupted = read_metrics(sweep_job(sweep_copy, 1)) | {"status": "interrupted"}
    (sweep_job(sweep_copy, 1) / "metrics.json").write_text(json.dumps(interrupted))
    code, out, _ = run_report(sweep_copy, capsys=capsys)
    assert code == 0
    rows = {job_number(row["job"]): row for row in read_csv(sweep_copy)}
    assert rows["3"]["status"] == "no metrics.json" and rows["1"]["status"] == "interrupted"
    assert rows["3"]["img_per_s"] == rows["1"]["img_per_s"] == rows["1"]["test_acc"] == ""
    assert rows["0"]["baseline"] == "yes" and rows["2"]["speedup"] != ""
    [amp] = markdown_rows(out, "amp")
    assert amp[3] == "1"  # only (amp on vs off, channels_last=false) still has both numbers


def test_baseline_can_be_chosen_by_overrides_or_folder(toggle_sweep, tmp_path, capsys):
    assert (
        run_report(
            toggle_sweep, "--out", tmp_path, "--baseline", "amp=true,channels_last=false", capsys=capsys
        )[0]
        == 0
    )
    [baseline] = [row for row in read_csv(tmp_path) if row["baseline"] == "yes"]
    assert (baseline["amp"], baseline["channels_last"]) == ("true", "false")
    assert float(baseline["speedup"]) == pytest.approx(1.0)
    for spec in ("3", "3_amp=true,channels_last=true"):  # the job's number, its name in the sweep
        assert run_report(toggle_sweep, "--out", tmp_path, "--baseline", spec, capsys=capsys)[0] == 0
        assert [job_number(row["job"]) for row in read_csv(tmp_path) if row["baseline"] == "yes"] == ["3"]


def test_a_baseline_that_matches_nothing_is_a_one_line_error(toggle_sweep, tmp_path, capsys):
    code, _, err = run_report(toggle_sweep, "--out", tmp_path, "--baseline", "amp=maybe", capsys=capsys)
    assert code == 1
    assert err.startswith("report: error: --baseline amp=maybe matches 0 rows") and err.count("\n") == 1


def test_time_to_target_accuracy_comes_from_the_history(toggle_sweep, tmp_path, capsys):
    metrics = job_metrics(toggle_sweep)
    lowest = min(job["test_acc"] for job in metrics.values())  # one evaluation: reached exactly, or beaten
    assert run_report(toggle_sweep, "--out", tmp_path, "--target-acc", lowest, capsys=capsys)[0] == 0
    for row in read_csv(tmp_path):
        [evaluated] = [entry for entry in metrics[row["job"]]["history"] if "test_acc" in entry]
        seconds = evaluated["train_time_s"] + evaluated["eval_s"]  # as the trainer counts it
        assert float(row["time_to_target_s"]) == pytest.approx(seconds)
    assert run_report(toggle_sweep, "--out", tmp_path, "--target-acc", "1.01", capsys=capsys)[0] == 0
    assert {row["time_to_target_s"] for row in read_csv(tmp_path)} == {""}


def test_time_to_target_recorded_by_the_runs_is_preferred(toggle_sweep, tmp_path, capsys):
    copy = copy_sweep(toggle_sweep, tmp_path / "sweep")
    for job in run_folders(copy):
        metrics = read_metrics(job)
        metrics.update(target_acc=0.5, time_to_target_s=123.0, epochs_to_target=1)
        (job / "metrics.json").write_text(json.dumps(metrics))
    for extra in ((), ("--target-acc", "0.5")):
        code, out, _ = run_report(copy, "--out", tmp_path, *extra, capsys=capsys)
        assert code == 0 and "first reached 50.00%" in out
        assert {float(row["time_to_target_s"]) for row in read_csv(tmp_path)} == {123.0}


def test_several_sweeps_make_one_report(toggle_sweep, seed_sweep, tmp_path, capsys):
    code, out, _ = run_report(toggle_sweep, seed_sweep, "--out", tmp_path, capsys=capsys)
    assert code == 0
    assert len(read_csv(tmp_path)) == 6  # 4 toggle settings + 2 learning rates (seeds grouped)
    assert "8 jobs in 6 rows" in out


@pytest.mark.parametrize("folder", ["empty", "absent"])
def test_a_folder_without_jobs_is_a_one_line_error(tmp_path, capsys, folder):
    (tmp_path / "empty").mkdir()
    code, out, err = run_report(tmp_path / folder, capsys=capsys)
    assert code == 1 and out == ""
    expected = "no job folders (folders holding .hydra/) under" if folder == "empty" else "no such folder"
    assert err.startswith(f"report: error: {expected}") and err.count("\n") == 1
    assert not (tmp_path / "empty" / "report.md").exists()


def test_a_two_valued_non_boolean_key_counts_as_a_toggle_from_the_baselines_value(
    toggle_sweep, tmp_path, capsys
):
    """A sweep over data.loader=torch,gpu is as much an ablation as one over a boolean."""
    sweep_copy = copy_sweep(toggle_sweep, tmp_path / "sweep", ignore=LEAN)
    for overrides in (job / ".hydra" / "overrides.yaml" for job in run_folders(sweep_copy)):
        text = overrides.read_text().replace("channels_last=False", "data.loader=torch")  # as Hydra writes it
        overrides.write_text(text.replace("channels_last=True", "data.loader=gpu"))
    # Named: left to itself the report takes the slower all-off row, and on a CPU either can be.
    code, out, _ = run_report(sweep_copy, "--baseline", "amp=false,data.loader=torch", capsys=capsys)
    assert code == 0
    speed = {(row["amp"], row["data.loader"]): float(row["img_per_s"]) for row in read_csv(sweep_copy)}
    gpu_on = statistics.geometric_mean(
        [speed["false", "gpu"] / speed["false", "torch"], speed["true", "gpu"] / speed["true", "torch"]]
    )
    [loader] = markdown_rows(out, "data.loader: torch → gpu")
    assert loader[1] == f"{gpu_on:.2f}×" and loader[3] == "2"
    assert markdown_rows(out, "amp")[0][3] == "2"


def test_one_epoch_images_per_second_is_marked_as_warm_up_and_given_no_speedup(seed_sweep, tmp_path, capsys):
    code, out, _ = run_report(seed_sweep, "--out", tmp_path, capsys=capsys)
    assert code == 0
    rows = {row["optim.lr"]: row for row in read_csv(tmp_path)}
    measured = rows["0.05"]
    assert measured["img_per_s_includes_warm_up"] == "yes" and measured["img_per_s"] != ""
    assert measured["speedup"] == "" and measured["baseline"] == "yes"  # still the accuracy's baseline
    assert float(measured["test_acc_change"]) == pytest.approx(0.0)
    assert rows["1e+30"]["img_per_s_includes_warm_up"] == ""  # failed: no images/s to mark
    [note] = [line for line in out.splitlines() if "epochs>=2" in line]
    assert note.startswith("img/s (with warm-up): every job timed only one epoch")
    [cells] = [cells for cells in markdown_rows(out, "") if "0.05" in cells]
    header = markdown_rows(out, "job")[0]
    assert cells[header.index("img/s")].endswith("(with warm-up)") and cells[header.index("speed-up")] == ""


def test_a_job_timed_with_its_warm_up_is_neither_baseline_nor_half_of_a_toggle_pair(
    toggle_sweep, tmp_path, capsys
):
    """Job 0 (every toggle off) cut back to its first epoch, as a one-epoch run records it."""
    sweep_copy = copy_sweep(toggle_sweep, tmp_path / "sweep", ignore=LEAN)
    first_epoch = read_metrics(sweep_job(sweep_copy, 0))
    first_epoch.update(history=first_epoch["history"][:1], img_per_s=first_epoch["history"][0]["img_per_s"])
    (sweep_job(sweep_copy, 0) / "metrics.json").write_text(json.dumps(first_epoch))
    code, out, _ = run_report(sweep_copy, capsys=capsys)
    assert code == 0
    rows = {job_number(row["job"]): row for row in read_csv(sweep_copy)}
    assert rows["0"]["img_per_s_includes_warm_up"] == "yes" and rows["0"]["speedup"] == ""
    assert rows["0"]["baseline"] == "" and rows["0"]["test_acc_change"] != ""
    others = {name: float(rows[name]["img_per_s"]) for name in ("1", "2", "3")}
    slowest = min(others, key=others.get)
    assert rows[slowest]["baseline"] == "yes" and "the slowest without warm-up in its images/s" in out
    for name, speed in others.items():
        assert float(rows[name]["speedup"]) == pytest.approx(speed / others[slowest])
    assert "img/s (with warm-up): job 0 timed only one epoch" in out
    [amp] = markdown_rows(out, "amp")
    [channels_last] = markdown_rows(out, "channels_last")
    assert amp[3] == channels_last[3] == "1"  # the pairs without job 0


@pytest.mark.parametrize(
    ("written", "problem"),
    [
        ("[1, 2, 3]", "metrics.json holds a list, not an object"),
        ('"done"', "metrics.json holds a str, not an object"),
        ('{"status": "completed", "img_per_s": "fast"}', "metrics.json's img_per_s is 'fast', not a number"),
        ('{"status": "completed", "history": [1, 2]}', "metrics.json's history is not a list of objects"),
        (
            '{"status": "completed", "history": [{"test_acc": "high"}]}',
            "metrics.json's history[0].test_acc is 'high', not a number",
        ),
    ],
)
def test_a_malformed_metrics_json_is_one_line_and_the_other_jobs_come_out(
    toggle_sweep, tmp_path, capsys, written, problem
):
    """R11: the job is reported as malformed, as a failed one is; no traceback."""
    sweep_copy = copy_sweep(toggle_sweep, tmp_path / "sweep")
    broken, *others = run_folders(sweep_copy)
    (broken / "metrics.json").write_text(written)
    code, out, _ = run_report(sweep_copy, "--out", tmp_path / "report", capsys=capsys)
    assert code == 0
    assert f"- {job_place(broken).name.split('_')[0]} ({broken}): malformed metrics.json: {problem}" in out
    rows = read_csv(tmp_path / "report")
    assert sum(int(row["n"] or 0) for row in rows) == len(others)
