"""trainer.trials, the runner behind scripts/bench.py, bench_ddp.py and time_to_accuracy.py:
one process per trial, its images/s without the warm-up epoch, repeats as median and spread,
results appended as they come."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SMALL, cli_environment, ends_soon

from trainer import trials

# A stand-in for a training process: writes the metrics.json it is given, then exits with a code.
FAKE_RUN = """
import json, pathlib, sys
folder, metrics, code = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
folder.mkdir(parents=True, exist_ok=True)
if metrics:
    (folder / "metrics.json").write_text(metrics)
print("training ...")
print("the last words", file=sys.stderr)
sys.exit(code)
"""


def epoch(img_per_s: float, data_wait_frac: float | None = 0.1) -> dict:
    return {"img_per_s": img_per_s, "epoch_s": 1.0, "data_wait_frac": data_wait_frac}


def fake_trial(run_dir: Path, metrics: dict | None, code: int = 0) -> trials.Trial:
    command = [
        sys.executable,
        "-c",
        FAKE_RUN,
        str(run_dir),
        json.dumps(metrics) if metrics else "",
        str(code),
    ]
    return trials.run_trial(command, run_dir)


def test_a_trial_is_timed_without_its_first_epoch(tmp_path):
    history = [epoch(10.0, 0.9), epoch(100.0, 0.2), epoch(120.0, 0.1), epoch(110.0, None)]
    metrics = {"status": "completed", "history": history, "peak_mem_mb": 512.0, "test_acc": 0.5}
    trial = fake_trial(tmp_path / "run", metrics)

    assert trial.failure is None and trial.returncode == 0 and trial.metrics == metrics
    assert (tmp_path / "run" / "output.log").read_text() == "training ...\nthe last words\n"
    assert trials.steady_numbers(trial) == {
        "status": "completed",
        "img_per_s": 110.0,  # the median of epochs 2-4: the 10 img/s warm-up epoch is left out
        "peak_mem_mb": 512.0,
        "data_wait_frac": pytest.approx(0.15),  # of epochs 2 and 3: epoch 4 measured none
        "test_acc": 0.5,
    }
    assert trials.timed_epochs(history[:1]) == history[:1]  # a single epoch is all there is
    assert trials.includes_warm_up({"history": history[:1]}) and not trials.includes_warm_up(metrics)


@pytest.mark.parametrize(
    ("metrics", "code"), [({"status": "failed", "history": []}, 1), (None, 0)], ids=["exit-1", "no-metrics"]
)
def test_a_failed_trial_says_why_in_one_line(tmp_path, metrics, code):
    trial = fake_trial(tmp_path / "run", metrics, code)

    assert trial.failure == "failed: the last words"
    assert trials.steady_numbers(trial) == {"status": "failed: the last words"}
    assert trials.Trial(tmp_path, {}, None, "", "", 300.0, 300.0).failure == "timed out after 300 s"


def test_repeats_give_the_median_and_the_spread_and_count_failures(capsys):
    speeds = iter([{"status": "completed", "img_per_s": rate, "peak_mem_mb": 100.0, "data_wait_frac": None}
                   for rate in (90.0, 110.0, 100.0)])  # fmt: skip
    runs = trials.repeat(lambda index: next(speeds) if index < 3 else {"status": "failed: oom"}, 4, "s | row")

    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" img/s")[0] for line in lines] == [
        "  s | row | run 1: 90",
        "  s | row | run 2: 110",
        "  s | row | run 3: 100",
        "  s | row | run 4: ",
    ]
    result = trials.median_and_spread(runs)
    assert result == {
        "runs": 3,
        "status": "1 run(s) failed",
        "img_per_s": 100.0,
        "min_img_per_s": 90.0,
        "max_img_per_s": 110.0,
        "peak_mem_mb": 100.0,
        "data_wait_frac": None,
    }
    assert trials.spread(result) == "90-110" and trials.spread({**result, "runs": 1}) == ""
    assert trials.median_and_spread([{"status": "failed: oom"}]) == {"runs": 0, "status": "failed: oom"}
    assert trials.median_of(runs, "img_per_s") == 100.0 and trials.median_of(runs, "test_acc") is None


def test_rounds_interleave_the_settings_and_a_hang_ends_only_its_own(capsys):
    order, kept = [], []

    def setting(name: str, status: str = "completed"):
        def run(index: int) -> dict:
            order.append(f"{name}{index + 1}")
            return {"status": status, "img_per_s": 100.0}

        return run

    runs = trials.rounds(
        {"a": setting("a"), "b": setting("b", "timed out after 9 s"), "c": setting("c")},
        3,
        after_round=lambda so_far: kept.append({label: len(done) for label, done in so_far.items()}),
    )

    assert order == ["a1", "b1", "c1", "a2", "c2", "a3", "c3"]
    assert [len(runs[label]) for label in "abc"] == [3, 1, 3]
    assert kept == [{"a": 1, "b": 1, "c": 1}, {"a": 2, "b": 1, "c": 2}, {"a": 3, "b": 1, "c": 3}]
    assert "  b | the other 2 run(s) skipped: run 1 timed out" in capsys.readouterr().out.splitlines()


def test_results_are_appended_as_json_lines(tmp_path):
    path = tmp_path / "results.jsonl"
    trials.append_jsonl(path, {"row": "a", "img_per_s": 1.5})
    trials.append_jsonl(path, {"row": "b", "img_per_s": None})
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"row": "a", "img_per_s": 1.5},
        {"row": "b", "img_per_s": None},
    ]


def test_a_real_trial_of_the_trainer(tmp_path):
    overrides = [*SMALL, "data.train_size=64", "epochs=2", "eval_every=2"]
    trial = trials.run_trial(
        trials.trainer_command(overrides, tmp_path / "run"),
        tmp_path / "run",
        env=cli_environment(),
    )

    assert trial.failure is None, trial.stderr[-2000:]
    numbers = trials.steady_numbers(trial)
    assert numbers["status"] == "completed"
    assert numbers["img_per_s"] == trial.metrics["history"][1]["img_per_s"]  # epoch 2 only
    assert numbers["test_acc"] == trial.metrics["test_acc"]


def test_a_trial_at_its_time_limit_takes_its_whole_process_group_along(tmp_path):
    # The shell starts a child (as the trainer starts DDP ranks and loader workers) and both
    # outlive the limit; the shell's output up to the limit is kept.
    command = ["sh", "-c", "sleep 600 & echo child $!; sleep 600"]
    trial = trials.run_trial(command, tmp_path / "run", timeout_s=3)

    assert trial.failure == "timed out after 3 s"
    child = int(trial.stdout.split()[1])
    assert (tmp_path / "run" / "output.log").read_text().startswith(f"child {child}")
    assert ends_soon(child), f"the trial's child {child} still runs after the trial's time limit"


def test_stopping_a_trial_stops_the_processes_it_moved_to_groups_of_their_own():
    # As DataLoader workers do (trainer.perf.inputs), the shell's child leaves the trial's
    # process group; killing the group alone would not reach it.
    trial = subprocess.Popen(
        ["sh", "-c", "setsid sh -c 'echo $$; exec sleep 600' & sleep 600"], stdout=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    child = int(trial.stdout.readline())
    assert os.getpgid(child) != trial.pid

    trials.kill_tree(trial.pid)
    trial.wait()
    assert ends_soon(child), f"process {child}, in a group of its own under the trial, still runs"


def test_a_timed_out_trial_ends_its_series(capsys):
    runs = trials.repeat(lambda index: {"status": "timed out after 300 s"}, 3, "s | row")

    assert len(runs) == 1
    last_line = capsys.readouterr().out.splitlines()[-1]
    assert last_line == "  s | row | the other 2 run(s) skipped: run 1 timed out"


def test_the_machine_names_the_gpu_by_its_uuid(monkeypatch):
    """Cloud machines of one kind share a host name ('vm'): only the GPU's UUID tells two apart."""
    import torch

    class Properties:
        uuid = "GPU-1234"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *_: Properties())
    one = trials.machine()
    Properties.uuid = "GPU-5678"
    assert "NVIDIA H200 GPU-1234" in one and one != trials.machine()
