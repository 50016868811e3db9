"""The recipe toggles act (TTA, EMA, target accuracy, export) and the trained model is usable:
one small run with all of them on, shared by most tests here (CPU)."""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import pytest
import torch
from conftest import compose_config, needs_subset, read_metrics, run_python
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from trainer import Trainer, tags
from trainer.config import ConfigError, ExportFormat, FlipMode, OptimizerName, TtaMode, to_train_config
from trainer.data import Normalizer, synthetic_split
from trainer.ema import WeightAverage, warmed_up_decay
from trainer.evaluate import EVALUATION, evaluate_run, evaluated_weights, main
from trainer.evaluation import evaluate, tta_views
from trainer.export import FILES, load_exported
from trainer.fastcnn import fastcnn
from trainer.progress import Progress

RECIPE = (
    "deterministic=true",
    "epochs=2",
    "data.train_size=128",  # 4 steps per epoch
    "data.cutout=8",
    "eval.tta=flip_translate",
    "ema.enabled=true",
    "ema.decay=0.5",
    "ema.update_every=2",
    "target_acc=0.05",
    "export=export",
)


def load_checkpoint(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)


@pytest.fixture(autouse=True, scope="module")
def restore_deterministic_mode():
    """deterministic=true switches torch into deterministic mode for the whole process."""
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("recipe") / "run"
    Trainer(compose_config(*RECIPE), run_dir).fit()
    return run_dir


def test_the_default_recipe_smooths_alternates_the_flip_and_evaluates_with_flip_tta():
    """What conf/recipe/default.yaml measured best at 20 epochs; the rest stays off, whatever
    perf preset is on, and each optimizer keeps its own lr."""
    for overrides in ((), ("perf=baseline",), ("perf=fast",)):
        cfg = to_train_config(compose_config(*overrides, small=False))
        assert (cfg.eval.tta, cfg.data.flip, cfg.optim.label_smoothing) == (
            TtaMode.flip,
            FlipMode.alternating,
            0.1,
        )
        assert (cfg.ema.enabled, cfg.data.cutout, cfg.target_acc, cfg.export) == (
            False,
            0,
            None,
            ExportFormat.none,
        )
        assert cfg.optim.lr == 0.1
    assert to_train_config(compose_config("optim=adamw", small=False)).optim.lr == 0.001


@pytest.mark.parametrize("recipe", ["resnet18_94", "resnet18_94_sgd", "fastcnn_94"])
def test_recipe_presets_set_how_to_train_and_leave_speed_to_perf(recipe):
    plain = to_train_config(compose_config("perf=fast", small=False))
    cfg = to_train_config(compose_config("perf=fast", f"recipe={recipe}", small=False))
    assert cfg.eval.tta is TtaMode.flip_translate and cfg.optim.label_smoothing > 0
    assert 1 < cfg.eval.from_epoch <= cfg.epochs  # no evaluation before the target can be reached
    speed = ("amp", "compile", "channels_last", "fused_optimizer", "set_to_none", "data")
    assert all(getattr(cfg, key) == getattr(plain, key) for key in speed[:-1])
    assert cfg.data.loader == plain.data.loader
    # The batch the recipe was measured at wins over perf=fast's.
    assert cfg.batch_size == to_train_config(compose_config(f"recipe={recipe}", small=False)).batch_size
    fastcnn_94 = to_train_config(compose_config("perf=fast", "recipe=fastcnn_94", small=False))
    assert fastcnn_94.batch_size == 2000 != plain.batch_size
    assert fastcnn_94.optim.name is OptimizerName.muon and fastcnn_94.optim.muon_fixed_norm
    assert (fastcnn_94.eval.tta, fastcnn_94.eval.tta_unsure) == (TtaMode.flip_translate, 0.25)


def test_resnet18_94_is_the_sgd_recipe_with_muon_for_the_convolutions_and_fewer_epochs():
    sgd = to_train_config(compose_config("perf=fast", "recipe=resnet18_94_sgd", small=False))
    muon = to_train_config(compose_config("perf=fast", "recipe=resnet18_94", small=False))
    assert sgd.optim.name is OptimizerName.sgd and muon.optim.name is OptimizerName.muon
    assert (muon.optim.muon_lr, muon.optim.muon_momentum, muon.optim.muon_ns_steps) == (0.12, 0.6, 3)
    assert muon.optim.muon_fixed_norm and muon.epochs == 14 < sgd.epochs
    assert muon.data.low_res_epochs < muon.eval.from_epoch <= muon.epochs
    assert (muon.batch_size, muon.eval.tta) == (sgd.batch_size, sgd.eval.tta)
    assert muon.data.cutout == sgd.data.cutout
    same = ("lr", "schedule", "label_smoothing", "weight_decay")
    assert [getattr(muon.optim, key) for key in same] == [getattr(sgd.optim, key) for key in same]


def test_the_two_gpu_recipe_is_the_muon_recipe_at_twice_the_batch_with_its_own_epochs():
    one = OmegaConf.to_container(compose_config("perf=fast", "recipe=resnet18_94", small=False))
    two = OmegaConf.to_container(compose_config("perf=fast", "recipe=resnet18_94_2gpu", small=False))

    def flat(tree: dict, prefix: str = "") -> dict:
        items = {}
        for key, value in tree.items():
            items.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
        return items

    changed = {key: value for key, value in flat(two).items() if flat(one)[key] != value}
    assert changed == {"ddp": True, "devices": 2, "epochs": 16, "eval.from_epoch": 14}
    assert flat(one)["batch_size"] == flat(two)["batch_size"] == 512  # per GPU: 1024 in all
    assert flat(two)["optim.name"] is OptimizerName.muon
    assert to_train_config(compose_config("recipe=resnet18_94_2gpu", small=False)).ddp_shard_muon


def test_tta_averages_the_logits_of_the_views():
    """A model that reads the left column as class 0 and twice the right column as class 1:
    images bright on the left and labelled 1 are all wrong plainly, all right with the mirror."""

    class Columns(nn.Module):
        def forward(self, images):
            return torch.stack([images[..., 0].mean(dim=(1, 2)), 2 * images[..., -1].mean(dim=(1, 2))], 1)

    images = torch.zeros(6, 3, 32, 32)
    images[..., :16] = 1.0
    batches = [(images, torch.ones(6, dtype=torch.long))]
    device = torch.device("cpu")
    assert evaluate(Columns(), batches, tta_views(TtaMode.none), device) == pytest.approx(
        {"test_loss": math.log(1 + math.e), "test_acc": 0.0}
    )
    assert evaluate(Columns(), batches, tta_views(TtaMode.flip), device)["test_acc_tta"] == 1.0


def test_tta_for_the_unsure_share_averages_only_the_least_sure_images():
    """eval.tta_unsure=0.5 on 4 images labelled 1, each brighter on the left than twice its right
    column (plainly class 0) by a margin that grows with its index: the 2 least sure (0 and 1)
    get the mirror and become right; 2 and 3 keep their plain, wrong logits. The model sees the
    4 images once and the 2 mirrored ones, not 4 x 2."""
    seen = []

    class Columns(nn.Module):
        def forward(self, images):
            seen.append(len(images))
            return torch.stack([images[..., 0].mean(dim=(1, 2)), 2 * images[..., -1].mean(dim=(1, 2))], 1)

    images = torch.zeros(4, 3, 32, 32)
    images[..., -1] = 0.4
    images[..., 0] = torch.tensor([0.81, 0.85, 2.0, 3.0]).view(4, 1, 1)
    batches = [(images, torch.ones(4, dtype=torch.long))]
    device = torch.device("cpu")
    everyone = evaluate(Columns(), batches, tta_views(TtaMode.flip), device)
    assert everyone["test_acc_tta"] == 1.0 and seen == [8]
    seen.clear()
    unsure = evaluate(Columns(), batches, tta_views(TtaMode.flip), device, unsure_share=0.5)
    assert unsure["test_acc_tta"] == 0.5 and seen == [4, 2]
    assert {key: unsure[key] for key in ("test_loss", "test_acc")} == {
        key: everyone[key] for key in ("test_loss", "test_acc")
    }


@pytest.mark.parametrize("share", [0, 1.5])
def test_a_tta_share_outside_zero_to_one_is_refused_in_one_line(share):
    with pytest.raises(ConfigError, match=r"eval.tta_unsure must be in \(0, 1\]"):
        to_train_config(compose_config("eval.tta=flip", f"eval.tta_unsure={share}"))


def test_translated_views_move_the_image_one_pixel_with_reflected_edges():
    images = torch.arange(2 * 3 * 32 * 32, dtype=torch.float32).view(2, 3, 32, 32)
    views = tta_views(TtaMode.flip_translate)
    assert len(views) == 6 and torch.equal(views[0](images), images)
    assert torch.equal(views[1](images), images.flip(-1))
    down_right, up_left = views[2](images), views[3](images)
    assert torch.equal(down_right[..., 1:, 1:], images[..., :-1, :-1])
    assert torch.equal(down_right[..., 0, 1:], images[..., 1, :-1])  # row -1 reflects row 1
    assert torch.equal(up_left[..., :-1, :-1], images[..., 1:, 1:])
    assert torch.equal(views[5](images), up_left.flip(-1))


def test_the_weight_average_warms_up_its_decay_and_averages_batchnorm_statistics():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    average = WeightAverage(model, decay=0.5, update_every=2)
    for step in range(1, 5):
        with torch.no_grad():
            model[0].weight.fill_(float(step))
            model[1].running_mean.fill_(10.0 * step)
        average.after_step(step)
    # updates at steps 2 (a copy) and 4, the second with the warmed-up decay 2/11, not 0.5
    torch.testing.assert_close(average.module[0].weight, torch.full((2, 2), 2 + 9 / 11 * (4 - 2)))
    torch.testing.assert_close(average.module[1].running_mean, torch.full((2,), 20 + 9 / 11 * (40 - 20)))
    assert average.module[1].num_batches_tracked == model[1].num_batches_tracked
    assert [warmed_up_decay(0.5, updates) for updates in (1, 8, 1000)] == [2 / 11, 0.5, 0.5]


def test_the_run_reports_tta_and_time_to_target(recipe_run):
    metrics = read_metrics(recipe_run)
    history = metrics["history"]
    assert all("test_acc_tta" in record and record["eval_s"] > 0 for record in history)
    assert metrics["test_acc_tta"] == history[-1]["test_acc_tta"]
    assert metrics["epochs_to_target"] == 1 and metrics["target_acc"] == 0.05
    counted = metrics["init_s"] + history[0]["train_time_s"] + history[0]["eval_s"]
    assert metrics["time_to_target_s"] == pytest.approx(counted)
    events = EventAccumulator(str(recipe_run / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    assert [event.value for event in events.Scalars(tags.TEST_ACC_TTA)] == [
        r["test_acc_tta"] for r in history
    ]
    # ema: the evaluated model (the average) under the usual names, the trained weights' beside it
    for tag, key in (
        (tags.TEST_ACC, "test_acc"),
        (tags.TEST_ACC_TTA, "test_acc_tta"),
        (tags.TRAINED_TEST_ACC, "test_acc_trained"),
        (tags.TRAINED_TEST_ACC_TTA, "test_acc_tta_trained"),
    ):
        assert [event.value for event in events.Scalars(tag)] == pytest.approx([r[key] for r in history])


def test_an_unreached_target_is_null():
    progress = Progress(epoch=3, train_time_s=5.0)
    progress.note_target({"test_acc": 0.9, "test_acc_tta": 0.93}, target_acc=0.94)
    assert progress.summary()["time_to_target_s"] is None and progress.epochs_to_target is None
    progress.note_target({"test_acc": 0.9, "test_acc_tta": 0.95}, target_acc=0.94)
    assert (progress.epochs_to_target, progress.time_to_target_s) == (3, 5.0)


def test_the_weight_average_is_checkpointed_and_is_what_is_evaluated(recipe_run):
    saved = load_checkpoint(recipe_run)
    assert saved["ema"]["n_averaged"] == 4  # 8 steps, every 2nd
    assert not torch.equal(saved["ema"]["module.0.weight"], saved["model"]["0.weight"])
    result = evaluate_run(str(recipe_run), [])
    assert result["weights"] == "ema" and result["tta"] == "flip_translate"
    metrics = read_metrics(recipe_run)
    for key in ("test_loss", "test_acc", "test_acc_tta"):
        assert result[key] == pytest.approx(metrics[key], abs=1e-6), key
    assert json.loads((recipe_run / EVALUATION).read_text()) == result
    assert result["checkpoint"] == str(Path("checkpoints") / "last.pt")  # the run folder's, however given
    flip = evaluate_run(str(recipe_run / "checkpoints" / "last.pt"), ["eval.tta=flip", "batch_size=50"])
    assert flip["test_acc"] == pytest.approx(metrics["test_acc"]) and "test_acc_tta" in flip
    # each evaluation keeps its own file: the one above is still there, this one beside it
    assert json.loads((recipe_run / EVALUATION).read_text()) == result
    assert json.loads((recipe_run / "evaluation_eval.tta=flip,batch_size=50.json").read_text()) == flip
    elsewhere = recipe_run.parent / "chosen.json"
    assert evaluate_run(str(recipe_run), ["batch_size=50"], out=elsewhere) == json.loads(
        elsewhere.read_text()
    )


@pytest.mark.filterwarnings("ignore:`torch.jit:FutureWarning")
@pytest.mark.parametrize("fmt", [ExportFormat.export, ExportFormat.torchscript])
def test_the_export_gives_the_checkpoints_logits(recipe_run, fmt):
    if fmt is ExportFormat.torchscript:
        evaluate_run(str(recipe_run), [], export=fmt)
    exported = load_exported(recipe_run / "export" / FILES[fmt])
    saved = load_checkpoint(recipe_run)
    model = Trainer(compose_config(*RECIPE), recipe_run.parent / "fresh").build().average.module
    model.load_state_dict(evaluated_weights(saved)[1])
    images = synthetic_split(5, train=False, seed=1).images
    expected = model.eval()(Normalizer(torch.device("cpu"))(images))
    torch.testing.assert_close(exported(images), expected)


def test_resume_with_ema_ends_with_the_uninterrupted_average(recipe_run, tmp_path):
    class StopAfterFirstEpoch(Trainer):
        def evaluate(self) -> dict:
            signal.raise_signal(signal.SIGTERM)  # as `kill` would: the run stops at this epoch's end
            return super().evaluate()

    assert StopAfterFirstEpoch(compose_config(*RECIPE), tmp_path / "stopped").fit()["steps"] == 4
    resumed = Trainer(compose_config(*RECIPE, f"resume={tmp_path / 'stopped'}"), tmp_path / "resumed").fit()
    assert resumed["steps"] == 8
    expected, actual = load_checkpoint(recipe_run)["ema"], load_checkpoint(tmp_path / "resumed")["ema"]
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[name], actual[name]) for name in expected)


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["nowhere"], "no checkpoint at nowhere: give a run folder that holds checkpoints/last.pt"),
        (["RUN", "eval.ttta=flip"], "unknown config key 'eval.ttta'. Did you mean 'eval.tta'?"),
        (["RUN", "eval.tta=sideways"], "invalid value for eval.tta"),
        (["RUN", "batch_size=abc"], "invalid value for batch_size: Value 'abc' of type 'str' could not be"),
        (["RUN", "data=synthetic"], "data is a group of settings, and evaluate keeps the run's own: set one"),
    ],
)
def test_bad_evaluate_input_is_one_line_and_a_failing_exit(recipe_run, capsys, argv, fragment):
    argv = [str(recipe_run) if arg == "RUN" else arg for arg in argv]
    assert main(argv) == 1
    error = capsys.readouterr().err
    assert error.startswith("evaluate: error: ") and fragment in error and error.count("\n") == 1


def test_evaluate_answers_command_line_mistakes_before_importing_torch(recipe_run):
    probe = (
        "import sys; from trainer.evaluate import main; code = main(sys.argv[1:]); "
        "print('torch imported' if 'torch' in sys.modules else 'torch not imported'); sys.exit(code)"
    )
    bad = ("eval.ttta=flip", "eval.tta", "eval.tta=sideways", "batch_size=abc")  # key, form, values
    for argv in (["nowhere"], *([str(recipe_run), override] for override in bad)):
        result = run_python(probe, *argv)
        assert result.returncode == 1 and result.stdout.strip() == "torch not imported", result.stderr
        assert result.stderr.startswith("evaluate: error: ")


def test_evaluate_says_where_it_wrote_relative_to_where_it_was_asked(recipe_run, capsys, monkeypatch):
    monkeypatch.chdir(recipe_run.parent)
    assert main([recipe_run.name]) == 0
    assert capsys.readouterr().err.splitlines()[-1] == f"wrote {Path(recipe_run.name) / EVALUATION}"
    written = json.loads((recipe_run / EVALUATION).read_text())
    assert written["checkpoint"] == str(Path("checkpoints") / "last.pt")


def test_fastcnn_learns_and_takes_channels_last():
    torch.manual_seed(0)
    model = fastcnn(10, conv_bias=False, widths=(16, 32, 64))  # narrower than the default, for a CPU
    normalize = Normalizer(torch.device("cpu"))
    train, test = synthetic_split(256, train=True, seed=0), synthetic_split(256, train=False, seed=0)
    model.initialize_from_data(normalize(train.images))
    trainable = [param for param in model.parameters() if param.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=1.5, momentum=0.85, nesterov=True)  # fastcnn_94's peak
    for _ in range(2):
        for start in range(0, 256, 32):
            images, labels = normalize(train.images[start : start + 32]), train.labels[start : start + 32]
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(images), labels).backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        images = normalize(test.images)
        logits = model(images)
        torch.testing.assert_close(model(images.contiguous(memory_format=torch.channels_last)), logits)
    assert (logits.argmax(1) == test.labels).float().mean() > 0.6  # chance is 0.1


def test_fastcnn_whitens_the_patches_of_the_images_it_is_initialized_from():
    images = Normalizer(torch.device("cpu"))(synthetic_split(300, train=True, seed=0).images)
    model = fastcnn(10)
    model.initialize_from_data(images)
    with torch.no_grad():
        outputs = nn.functional.conv2d(images, model.whiten.weight)  # (N, 24, 31, 31), no bias
    first_sign = outputs[:, :12].transpose(0, 1).flatten(1)
    covariance = torch.cov(first_sign.double())
    # Unit variance and no correlation, but for the eigenvalues the 5e-4 regularizer holds back.
    torch.testing.assert_close(covariance, torch.eye(12, dtype=torch.float64), atol=0.05, rtol=0)
    torch.testing.assert_close(outputs[:, 12:], -outputs[:, :12])
    assert not model.whiten.weight.requires_grad and not model.layer1[2].weight.requires_grad


def test_model_fastcnn_builds_trains_and_checkpoints(tmp_path):
    overrides = ("model=fastcnn", "data.train_size=32", "data.test_size=16", "max_steps=1", "target_acc=0.01")
    metrics = Trainer(compose_config(*overrides), tmp_path / "run").fit()
    assert metrics["status"] == "completed" and metrics["flops_per_image"] > 0
    # its whitening from the data is timed, and counted in the time to target as training
    assert metrics["init_s"] > 0
    assert metrics["time_to_target_s"] == pytest.approx(
        metrics["init_s"] + metrics["train_time_s"] + metrics["eval_time_s"]
    )
    saved = load_checkpoint(tmp_path / "run")
    fresh = fastcnn(10)
    fresh.load_state_dict(saved["model"])
    assert saved["config"]["model"]["name"] == "fastcnn"


@needs_subset
def test_the_weight_average_of_a_short_real_run_is_as_good_as_the_trained_weights(real_image_run):
    """78 steps on real images, an update every 5th: a fixed 0.98 decay left 74% of the average
    at the random initialization (chance accuracy); warmed up, it tracks the trained weights."""
    trained = real_image_run["trained_test_acc"]
    assert trained > 0.3  # chance is 0.1
    metrics = real_image_run["metrics"]
    assert metrics["test_acc"] == pytest.approx(trained, abs=0.04)
    # the run itself reports the trained weights' accuracy beside the average's, every evaluation
    assert metrics["test_acc_trained"] == pytest.approx(trained, abs=1e-6)
    assert all("test_acc_trained" in record for record in metrics["history"] if "test_acc" in record)


def test_the_warm_up_puts_back_every_state_it_changed(tmp_path):
    """The compile warm-up trains 3 steps and evaluates once before the clock; the run then
    ends with the weights of a run without it, and its seconds are compile_s."""
    # half of SMALL's images a step, a quarter of its test images: under amp (bf16) a CPU
    # without AVX-512 takes ~1 s for a step of 32; max_steps still ends the run mid-epoch
    overrides = (
        "deterministic=true",
        "max_steps=4",
        "optim=adamw",
        "amp=true",
        "batch_size=16",
        "data.train_size=128",
        "data.test_size=32",
    )
    plain = Trainer(compose_config(*overrides), tmp_path / "plain")
    plain.fit()
    warmed = Trainer(compose_config(*overrides), tmp_path / "warmed").build()
    assert warmed.warm_up_steps == 0  # nothing to compile or autotune on a CPU without compile
    warmed.warm_up_steps = 3
    metrics = warmed.fit()
    for name, value in plain.raw_model.state_dict().items():
        torch.testing.assert_close(warmed.raw_model.state_dict()[name], value, rtol=0, atol=0)
    assert metrics["compile_s"] > 0 and read_metrics(tmp_path / "plain")["compile_s"] == 0
    assert metrics["steps"] == 4 and metrics["wall_s"] > metrics["train_time_s"]
    # the assembly and the warm-up are counted apart from each other, both inside wall_s
    assert 0 < metrics["setup_s"] < metrics["wall_s"] - metrics["compile_s"]
    assert 0 < metrics["setup_data_s"] < metrics["setup_s"]  # the data, of the assembly


def test_wall_seconds_count_the_process_for_its_first_run_and_the_job_for_a_later_one(monkeypatch):
    from trainer import timing

    # Bracketed by readings taken around it, not compared within a tolerance in seconds: a busy
    # machine can pause the test between any two lines.
    monkeypatch.setattr(timing, "_runs_started", 0)
    timing.start_run()
    before, wall, after = timing.process_age_s(), timing.wall_s(), timing.process_age_s()
    assert before <= wall <= after  # the first run: the process's age
    monkeypatch.setattr(timing, "_run_started", timing.time.monotonic() + 1e6)
    assert timing.wall_s() >= after  # still the process's age, whatever the job's start says
    started = timing.time.monotonic()
    timing.start_run()  # a sweep's next job in the same process
    wall, since_started = timing.wall_s(), timing.time.monotonic() - started
    assert 0 <= wall <= since_started < timing.process_age_s()  # the job's seconds, not the process's


def test_crop_padding_bounds_the_shift_of_the_training_crops(tmp_path):
    """With no padding a crop is the whole image: every training image is the original or its
    mirror; with the default 4 pixels most are shifted."""
    for padding, unshifted in ((0, True), (4, False)):
        trainer = Trainer(compose_config(f"data.crop_padding={padding}"), tmp_path / str(padding)).build()
        trainer.train_loader.set_epoch(0)
        originals = trainer.train_loader.dataset.images
        images, _ = next(iter(trainer.train_loader))
        index = trainer.train_loader.sampler.epoch_indices()[: len(images)]
        plain = torch.from_numpy(originals[index])
        same = [torch.equal(image, p) or torch.equal(image, p.flip(-1)) for image, p in zip(images, plain)]
        assert all(same) if unshifted else sum(same) < len(same) / 2


def test_alternating_flip_shows_every_image_both_ways_in_any_two_consecutive_epochs(tmp_path):
    """data.flip=alternating: with no crop shift, an image's two views in epochs e and e + 1
    are mirrors of each other; with random flips about half of them are the same view."""

    def views(flip: str, epoch: int) -> dict[int, torch.Tensor]:
        trainer = Trainer(compose_config("data.crop_padding=0", f"data.flip={flip}"), tmp_path / flip).build()
        trainer.train_loader.set_epoch(epoch)
        images = torch.cat([batch for batch, _ in trainer.train_loader])
        order = trainer.train_loader.sampler.epoch_indices()[: len(images)]
        return dict(zip(order.tolist(), images))

    for flip, mirrored in (("alternating", True), ("random", False)):
        for epoch in (0, 1):
            first, second = views(flip, epoch), views(flip, epoch + 1)
            shared = sorted(first.keys() & second.keys())
            assert len(shared) > 100
            mirrors = [torch.equal(first[i], second[i].flip(-1)) for i in shared]
            assert all(mirrors) if mirrored else 0.3 < sum(mirrors) / len(mirrors) < 0.7


def test_norm_bias_lr_scale_trains_the_batchnorm_shifts_in_a_group_of_their_own(tmp_path):
    overrides = ("model=fastcnn", "data.train_size=32", "optim.norm_bias_lr_scale=64")
    trainer = Trainer(compose_config(*overrides), tmp_path / "run").build()
    others, shifts = trainer.optimizer.param_groups
    norms = [m for m in trainer.raw_model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert {id(p) for p in shifts["params"]} == {id(m.bias) for m in norms}
    assert shifts["lr"] == pytest.approx(64 * others["lr"])
    assert shifts["weight_decay"] == pytest.approx(others["weight_decay"] / 64)
    plain = Trainer(compose_config(*overrides[:2]), tmp_path / "plain").build()
    assert len(plain.optimizer.param_groups) == 1


def test_eval_from_epoch_leaves_the_earlier_epochs_unevaluated(tmp_path):
    metrics = Trainer(compose_config("epochs=3", "eval.from_epoch=2"), tmp_path / "run").fit()
    assert ["test_acc" in record for record in metrics["history"]] == [False, True, True]


def test_the_epoch_line_shows_the_tta_accuracy_beside_the_single_view():
    from trainer.epoch_report import accuracy_cell

    assert accuracy_cell({"test_acc": 0.9, "test_acc_tta": 0.93}) == "0.9000 (tta 0.9300)"
    assert accuracy_cell({"test_acc": 0.9}) == "0.9000" and accuracy_cell({}) == "-"
