"""`python -m trainer` end to end: the run folder, metrics.json, TensorBoard scalars, and a `-m` sweep."""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch
from conftest import SMALL, TOGGLE_SWEEP, compose_config, read_metrics, run_cli, run_folders
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainer import Trainer, tags
from trainer.job_names import run_dir_name

TAGS = (
    tags.TRAIN_LOSS,
    tags.TRAIN_ACC,
    tags.TEST_LOSS,
    tags.TEST_ACC,
    tags.IMG_PER_S,
    tags.IMG_PER_S_EPOCH,
    tags.EPOCH_S,
)
SWEEP_STAMP = r"\d{4}-\d{2}-\d{2}/\d{2}-\d{2}-\d{2}\.\d{6}"  # a sweep's <date>/<time with microseconds>
RUN_STAMP = r"\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}\.\d{6}"  # a single run's, after its overrides


def scalars(run, folder: str = "tb") -> dict[str, list[tuple[int, float]]]:
    """Every TensorBoard scalar of the run's tb/ (or schedule/): tag -> [(step, value), ...]."""
    events = EventAccumulator(str(run / folder), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_a_run_leaves_one_folder_with_checkpoint_metrics_and_tensorboard(tmp_path):
    overrides = [*SMALL, "epochs=2"]  # 256 images / batch 32: 8 steps per epoch, loss logged every 2

    result = run_cli(*overrides, cwd=tmp_path)

    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    [run] = run_folders(tmp_path / "outputs")
    # named by what the command line changed, then the date and time
    assert re.fullmatch(
        f"{re.escape(run_dir_name(overrides))}/{RUN_STAMP}", run.relative_to(tmp_path / "outputs").as_posix()
    )
    assert run.parent.name.startswith("model=cnn,data=synthetic,")
    assert (run / ".hydra" / "config.yaml").is_file()
    assert (run / "tb").is_dir()
    assert (run / "checkpoints" / "last.pt").is_file()

    metrics = read_metrics(run)
    assert metrics["status"] == "completed"
    assert metrics["epochs"] == 2
    assert metrics["steps"] == 16
    assert 0.0 <= metrics["test_acc"] <= metrics["best_test_acc"] <= 1.0
    assert math.isfinite(metrics["train_loss"]) and metrics["train_loss"] > 0
    assert metrics["img_per_s"] > 0
    assert metrics["train_time_s"] > 0
    assert metrics["peak_mem_mb"] is None  # CUDA-only measurement
    assert metrics["device"] == "cpu"
    assert metrics["overrides"] == overrides
    assert torch.load(run / "checkpoints" / "last.pt", weights_only=False)["step"] == 16

    logged = scalars(run)
    assert set(TAGS) <= set(logged)
    # the x axis is images trained on (tb_step=images): optimizer steps x the batch of 32
    assert [x for x, _ in logged[tags.TRAIN_LOSS]] == [32 * step for step in (2, 4, 6, 8, 10, 12, 14, 16)]
    assert all(math.isfinite(loss) and loss > 0 for _, loss in logged[tags.TRAIN_LOSS])
    settings = scalars(run, "schedule")  # a TensorBoard run of its own: not an HParams metric
    assert tags.LR not in logged and set(settings) == {tags.LR}
    assert all(lr > 0 for _, lr in settings[tags.LR])
    assert [x for x, _ in logged[tags.TEST_ACC]] == [32 * 8, 32 * 16]
    assert all(0.0 <= accuracy <= 1.0 for _, accuracy in logged[tags.TEST_ACC])
    assert math.isclose(logged[tags.TEST_ACC][-1][1], metrics["test_acc"], rel_tol=1e-6)  # TB holds float32
    assert all(0.0 <= accuracy <= 1.0 for _, accuracy in logged[tags.TRAIN_ACC])
    assert all(value > 0 for _, value in logged[tags.IMG_PER_S] + logged[tags.EPOCH_S])
    assert len(logged[tags.EPOCH_S]) == 2
    # one definition of images/s: the last point is metrics.json's (the epochs after the first)
    assert math.isclose(logged[tags.IMG_PER_S][-1][1], metrics["img_per_s"], rel_tol=1e-6)
    assert math.isclose(
        logged[tags.IMG_PER_S_EPOCH][-1][1], metrics["history"][-1]["img_per_s"], rel_tol=1e-6
    )


def test_a_sweep_leaves_one_completed_folder_per_job_beside_the_single_runs(toggle_sweep):
    """outputs/multirun/<date>/<time> holds the sweep's multirun.yaml; each job is
    outputs/<the values it was swept over>/<date>_<time>_<job>, as a single run is
    outputs/<its overrides>/<date>_<time>: TensorBoard's run names start with what differs."""
    outputs = toggle_sweep.parents[2]  # <cwd>/outputs/multirun/<date>/<time>
    assert re.fullmatch(f"multirun/{SWEEP_STAMP}", toggle_sweep.relative_to(outputs).as_posix())
    assert (toggle_sweep / "multirun.yaml").is_file()
    assert not list((outputs / "multirun").rglob(".hydra"))  # no job inside the sweep folder
    runs = run_folders(outputs)
    assert runs == run_folders(toggle_sweep)  # the sweep's jobs, found from its folder
    settings = [(amp, layout) for amp in (False, True) for layout in (False, True)]  # Hydra's job order
    assert len(set(runs)) == len(settings)
    stamp = f"{toggle_sweep.parent.name}_{toggle_sweep.name}"
    for job, (run, (amp, layout)) in enumerate(zip(runs, settings)):
        swept = f"amp={str(amp).lower()},channels_last={str(layout).lower()}"  # the swept keys only
        assert run.relative_to(outputs).as_posix() == f"{swept}/{stamp}_{job}"
        metrics = read_metrics(run)
        assert metrics["status"] == "completed"
        assert metrics["overrides"] == [*TOGGLE_SWEEP, f"amp={amp}", f"channels_last={layout}"]
        assert metrics["steps"] == 4  # 2 epochs of 64 images / batch 32
        assert (run / "checkpoints" / "last.pt").is_file()


def test_tb_step_puts_optimizer_steps_or_images_on_the_x_axis(tmp_path):
    """Batches of 32, two per optimizer step (grad_accum_steps=2): images advance 64 a step."""
    overrides = ("max_steps=2", "log_every=1", "grad_accum_steps=2", "data.train_size=128")
    for axis, per_step in (("images", 64), ("step", 1)):
        Trainer(compose_config(*overrides, f"tb_step={axis}"), tmp_path / axis).fit()
        assert [x for x, _ in scalars(tmp_path / axis)[tags.TRAIN_LOSS]] == [per_step, 2 * per_step], axis
    logged = scalars(tmp_path / "step")
    assert not {tags.TRAINED_TEST_ACC, tags.TRAINED_TEST_ACC_TTA} & set(
        logged
    )  # only beside a weight average


def test_a_sweep_job_is_named_by_the_values_it_was_swept_over(tmp_path):
    from trainer.job_names import job_dir_name

    task = ["model=cnn", "amp=false,true", "data.root=/data/cifar 10", "+optim.x=1,2"]
    (tmp_path / "multirun.yaml").write_text(f"hydra:\n  overrides:\n    task: {task}\n")
    job = ["model=cnn", "amp=True", "data.root=/data/cifar 10", "+optim.x=2"]
    assert job_dir_name(3, job, str(tmp_path)) == "3_amp=true,+optim.x=2"
    # without the sweep's command line (another launcher): every override, made safe for a path
    assert (
        job_dir_name(3, job, str(tmp_path / "absent"))
        == "3_model=cnn,amp=true,data.root=-data-cifar-10,+optim.x=2"
    )
    long = job_dir_name(12, [f"data.root=/{'x' * 300}"], str(tmp_path / "absent"))
    assert (
        long.startswith("12_data.root=-xxx")
        and len(long) == 3 + 96
        and long != job_dir_name(12, [f"data.root=/{'x' * 301}"], str(tmp_path / "absent"))
    )
    assert job_dir_name(0, [], str(tmp_path)) == "0"


def test_the_default_sweep_folder_puts_its_jobs_beside_the_single_runs_and_finds_them_again(
    tmp_path, monkeypatch
):
    from trainer.job_names import job_dir_name, job_place, sweep_jobs

    sweep = tmp_path / "outputs" / "multirun" / "2026-11-26" / "05-53-03.123456"
    sweep.mkdir(parents=True)
    (sweep / "multirun.yaml").write_text("hydra:\n  overrides:\n    task: [model=cnn, 'seed=0,1']\n")
    names = [job_dir_name(n, ["model=cnn", f"seed={n}"], str(sweep)) for n in (0, 1)]
    outputs = str(tmp_path / "outputs")
    assert names == [f"{outputs}/seed={n}/2026-11-26_05-53-03.123456_{n}" for n in (0, 1)]  # absolute
    # a sweep that sweeps nothing: its jobs under their overrides, as a single run of them
    (sweep / "multirun.yaml").write_text("hydra:\n  overrides:\n    task: [model=cnn]\n")
    assert job_dir_name(0, ["model=cnn"], str(sweep)) == f"{outputs}/model=cnn/2026-11-26_05-53-03.123456_0"
    jobs = [Path(name) for name in reversed(names)]
    single = tmp_path / "outputs" / "seed=0" / "2026-11-26_05-53-03.123456"  # a single run, same second
    other = tmp_path / "outputs" / "seed=0" / "2026-11-26_05-53-03.999999_0"  # another sweep's job
    for folder in (*jobs, single, other):
        (folder / ".hydra").mkdir(parents=True)
    assert sweep_jobs(sweep) == jobs[::-1]  # in job order, no other run
    assert [job_place(job) for job in jobs[::-1]] == [sweep / "0_seed=0", sweep / "1_seed=1"]
    assert job_place(single) == single and job_place(other) == other  # no such sweep folder
    # from inside the sweep folder, as `python -m trainer.report .` names it
    monkeypatch.chdir(sweep)
    assert sweep_jobs(Path(".")) == jobs[::-1]
    assert job_place(Path("../../../seed=0") / jobs[1].name) == sweep / "0_seed=0"
