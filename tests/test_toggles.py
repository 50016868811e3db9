"""Each optimization toggle takes effect in the running Trainer (CPU)."""

from __future__ import annotations

import contextlib
import logging
import threading

import numpy as np
import pytest
import torch
from conftest import compose_config
from torch import nn

from trainer import Trainer, perf
from trainer.config import to_train_config
from trainer.data import GpuLoader, ImageSplit, Splits, crop_and_flip, gpu_loaders, torch_loaders
from trainer.data.augment import CUTOUT_FILL, DEFAULT_CROP_FLIP, CropFlip
from trainer.models import CheckpointedStage, build_model
from trainer.perf import Moved, cpu_bf16


def built(tmp_path, *overrides: str) -> Trainer:
    return Trainer(compose_config(*overrides), tmp_path / "run").build()


def first(model: nn.Module, kind: type) -> nn.Module:
    return next(module for module in model.modules() if isinstance(module, kind))


@pytest.fixture(autouse=True)
def restore_backend_flags():
    saved = (
        torch.backends.cudnn.benchmark,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.are_deterministic_algorithms_enabled(),
    )
    yield
    torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32 = saved[0], saved[1]
    torch.backends.cudnn.allow_tf32 = saved[2]
    torch.use_deterministic_algorithms(saved[3])


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ((), torch.float32),
        (("amp=true",), torch.bfloat16),
        (("amp=true", "amp_dtype=bf16"), torch.bfloat16),
    ],
)
def test_amp_sets_the_dtype_seen_inside_forward(tmp_path, overrides, expected):
    # 32 test images: bf16 autocast on a CPU without AVX-512 costs ~1 s a batch of 32
    trainer = built(tmp_path, "max_steps=2", "data.test_size=32", *overrides)
    seen = []
    first(trainer.raw_model, nn.Conv2d).register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    trainer.fit()
    assert seen and set(seen) == {expected}
    assert not trainer.scaler.is_enabled()  # loss scaling is for fp16 on CUDA only


def test_fp16_on_cpu_says_so_and_uses_bf16(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    trainer = built(tmp_path, "amp=true", "amp_dtype=fp16")
    with trainer.autocast():
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert "amp_dtype=fp16 has no effect here" in caplog.text


def count_optimizer_steps(trainer: Trainer) -> list[int]:
    steps = []
    trainer.optimizer.register_step_post_hook(lambda *_: steps.append(1))
    return steps


@pytest.mark.parametrize(
    ("train_size", "accum", "expected_steps"),
    [
        (256, 1, 8),  # 8 micro-batches of 32
        (256, 2, 4),
        (224, 2, 4),  # 7 micro-batches: 3 full groups + a trailing group of 1
        (224, 4, 2),
    ],
)
def test_grad_accum_steps_the_optimizer_once_per_group(tmp_path, train_size, accum, expected_steps):
    trainer = built(tmp_path, f"data.train_size={train_size}", f"grad_accum_steps={accum}")
    steps = count_optimizer_steps(trainer)
    metrics = trainer.fit()
    assert len(steps) == expected_steps == metrics["steps"]


def test_accumulated_step_equals_one_big_step(tmp_path):
    """k micro-batches of b/k give the same update as one batch of b (the cnn has no BatchNorm)."""
    weights = []
    for batch, accum in ((32, 1), (16, 2), (8, 4)):
        trainer = built(
            tmp_path / f"{accum}",
            "max_steps=1",
            f"batch_size={batch}",
            f"grad_accum_steps={accum}",
            "deterministic=true",
        )
        trainer.fit()
        weights.append(torch.cat([p.detach().flatten() for p in trainer.raw_model.parameters()]))
    for other in weights[1:]:
        torch.testing.assert_close(other, weights[0], rtol=1e-5, atol=1e-6)


def test_accumulation_plan_divides_a_trailing_group_by_its_size():
    from trainer.trainer import accumulation_plan

    plan = accumulation_plan(7, 3)
    assert plan == [(3, False), (3, False), (3, True), (3, False), (3, False), (3, True), (1, True)]


@pytest.mark.parametrize("set_to_none", [False, True])
def test_set_to_none_drops_or_zeroes_grads(tmp_path, set_to_none):
    trainer = built(tmp_path, "max_steps=2", f"set_to_none={str(set_to_none).lower()}")
    trainer.fit()
    grads = [p.grad for p in trainer.raw_model.parameters()]
    if set_to_none:
        assert all(g is None for g in grads)
    else:
        assert all(g is not None and not g.any() for g in grads)


def test_dataloader_fields_follow_the_toggles(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    trainer = built(
        tmp_path,
        "num_workers=2",
        "persistent_workers=true",
        "prefetch_factor=3",
        "pin_memory=true",
        "non_blocking=true",
    )
    loader = trainer.train_loader
    assert (loader.num_workers, loader.persistent_workers, loader.prefetch_factor) == (2, True, 3)
    assert loader.pin_memory is False  # CPU: nothing to pin for, and the log says so
    # Said once each (the test loader is moved too), at DEBUG: these are the defaults.
    for toggle in ("pin_memory=true", "non_blocking=true"):
        [record] = [r for r in caplog.records if r.getMessage().startswith(f"{toggle} has no effect here")]
        assert record.levelno == logging.DEBUG
    assert built(tmp_path / "plain").train_loader.num_workers == 0


@pytest.mark.parametrize("slowdown", [None, 11.2])
def test_amp_on_a_cpu_where_bf16_is_slower_warns_by_how_much(tmp_path, caplog, monkeypatch, slowdown):
    monkeypatch.setattr(perf, "cpu_bf16_slowdown", lambda: slowdown)
    with caplog.at_level(logging.WARNING, logger="trainer.perf"):
        built(tmp_path, "amp=true")
    warned = [r.getMessage() for r in caplog.records if "amp=true on this CPU" in r.getMessage()]
    assert len(warned) == (0 if slowdown is None else 1)
    if slowdown:
        assert "ran 11.2x slower than fp32 here" in warned[0] and "Set amp=false" in warned[0]


@pytest.mark.parametrize(
    ("amx", "ratio", "said"),
    [
        (True, 9.0, None),
        (False, 9.0, 9.0),
        (False, 2.2, 2.2),  # a Xeon's amp training was 2.2x slower: said (a threshold of 3 missed it)
        (False, 1.4, 1.4),
        (False, 1.1, None),
        (False, 0.59, None),  # bf16 faster (the EPYC here)
    ],
)
def test_the_cpu_bf16_probe_calls_bf16_slower_only_clearly_and_never_with_amx(monkeypatch, amx, ratio, said):
    monkeypatch.setattr(cpu_bf16, "cpu_has_amx", lambda: amx)
    monkeypatch.setattr(cpu_bf16, "bf16_conv_slowdown", lambda: ratio)
    assert cpu_bf16.cpu_bf16_slowdown() == said


def test_the_cpu_bf16_probe_takes_turns_and_compares_the_fastest_of_each(monkeypatch):
    order, seconds = [], iter([9.0, 9.0, 0.2, 5.0, 0.1, 1.0, 0.3, 0.8])  # untimed pair first
    monkeypatch.setattr(
        cpu_bf16, "_step_seconds", lambda weight, images, bf16: order.append(bf16) or next(seconds)
    )
    assert cpu_bf16.bf16_conv_slowdown.__wrapped__(repeats=3) == pytest.approx(0.8 / 0.1)
    assert order == [False, True] * 4


def test_the_cpu_bf16_probe_runs_both_steps_and_leaves_the_random_state_alone():
    state = torch.random.get_rng_state()
    generator = torch.Generator().manual_seed(0)
    weight, images = (
        torch.randn(4, 4, 3, 3, generator=generator),
        torch.randn(1, 4, 8, 8, generator=generator),
    )
    for bf16 in (False, True):
        weight.grad = images.grad = None
        assert cpu_bf16._step_seconds(weight.requires_grad_(), images.requires_grad_(), bf16) > 0
        assert weight.grad is not None and images.grad is not None  # a backward step, both gradients
    assert cpu_bf16.bf16_conv_slowdown.__wrapped__(repeats=1) > 0
    assert torch.equal(torch.random.get_rng_state(), state)


def test_prefetch_on_cpu_says_so_and_moves_batches_plainly(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    trainer = built(tmp_path, "data.prefetch=true")
    assert isinstance(trainer.train_batches, Moved)
    assert "data.prefetch=true has no effect here" in caplog.text


def test_channels_last_reaches_parameters_and_every_batch(tmp_path):
    trainer = built(tmp_path, "channels_last=true", "max_steps=3")
    inputs = []
    first(trainer.raw_model, nn.Conv2d).register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
    trainer.fit()
    convs = [m.weight for m in trainer.raw_model.modules() if isinstance(m, nn.Conv2d)]
    assert all(w.is_contiguous(memory_format=torch.channels_last) for w in convs)
    assert len(inputs) >= 3
    assert all(x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous() for x in inputs)


def test_backend_flags(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    built(tmp_path, "cudnn_benchmark=true", "tf32=true")
    assert torch.backends.cudnn.benchmark
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert "cudnn_benchmark=true has no effect here" in caplog.text
    assert "tf32=true has no effect here" in caplog.text
    built(tmp_path / "off")
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32


def test_data_parallel_turns_cudnn_autotuning_off(monkeypatch, caplog):
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)  # put back afterwards
    caplog.set_level(logging.INFO)
    gpu = torch.device("cuda", 0)  # only its type is read: no CUDA needed
    split = to_train_config(compose_config("data_parallel=true", "devices=2", "cudnn_benchmark=true"))
    perf.apply_backend_flags(split, gpu)
    assert not torch.backends.cudnn.benchmark
    assert "cudnn_benchmark=true has no effect here (data_parallel=true would autotune" in caplog.text

    perf.apply_backend_flags(to_train_config(compose_config("devices=2", "cudnn_benchmark=true")), gpu)
    assert torch.backends.cudnn.benchmark


def test_fused_optimizer(tmp_path):
    assert built(tmp_path, "fused_optimizer=true").optimizer.defaults["fused"] is True
    assert not built(tmp_path / "plain").optimizer.defaults.get("fused")


def test_compile_really_compiles_and_says_what_the_warm_up_does(tmp_path, caplog, monkeypatch):
    """...and stops inductor's compile workers after the warm-up, beside the training, where
    they would otherwise hold the process's exit."""
    from torch._dynamo.utils import counters

    caplog.set_level(logging.INFO)
    torch._dynamo.reset()
    counters.clear()
    stopping, stop = [], perf.stop_compile_workers
    monkeypatch.setattr(perf, "stop_compile_workers", lambda: stopping.append(stop()))
    trainer = built(tmp_path, "compile=true", "max_steps=2", "data.train_size=64", "data.test_size=32")
    assert isinstance(trainer.model, torch._dynamo.eval_frame.OptimizedModule)
    trainer.fit()
    assert counters["stats"]["unique_graphs"] >= 1
    [thread] = stopping
    thread.join()
    assert not torch._inductor.async_compile._pool_set  # stopped (or, on a CPU, never started)
    torch._dynamo.reset()
    lines = caplog.messages
    assert any(line.startswith("compile=true on a CPU: compiling takes minutes") for line in lines)
    [start] = [line for line in lines if line.startswith("warm-up: 3 steps per image size")]
    assert "(torch.compile, default)" in start and "a first run of these settings compiles" in start
    assert lines.index(start) < next(i for i, line in enumerate(lines) if "compiled and autotuned in" in line)


def test_a_long_block_says_it_still_runs(caplog):
    import time

    from trainer.console import still_running

    caplog.set_level(logging.INFO)
    with still_running("warm-up", every_s=0.05):
        time.sleep(0.5)  # ten intervals: at least one line, however busy the machine
    said = [line for line in caplog.messages if line.startswith("warm-up: still running, ")]
    assert said and all(line.endswith(" s so far") for line in said)
    time.sleep(0.2)
    assert len([line for line in caplog.messages if line.startswith("warm-up: still running")]) == len(said)


def test_cuda_graphs_off_cuda_compile_in_the_default_mode_and_say_so_once(caplog):
    from trainer.perf.model import NoCudaRuntimeFilter, compile_mode
    from trainer.perf.notes import forget_said

    forget_said()  # as a run's start does: an earlier test's run may have said it
    cfg = to_train_config(compose_config("perf=fast"))
    assert cfg.compile_mode.value == "reduce-overhead"
    with caplog.at_level(logging.DEBUG, logger="trainer.perf"):
        assert compile_mode(cfg, torch.device("cpu")) == "default"
        assert compile_mode(cfg, torch.device("cpu")) == "default"
    line = "compile_mode=reduce_overhead has no effect"
    said = [r for r in caplog.records if r.getMessage().startswith(line)]
    assert [r.levelno for r in said] == [logging.INFO]  # perf=fast asked for it
    # torch's "No CUDA runtime is found" on importing cpp_extension is nothing this run can act
    # on: that line is dropped, once however many runs, and the logger's other warnings pass.
    cpp_extension = logging.getLogger("torch.utils.cpp_extension")
    [dropping] = [known for known in cpp_extension.filters if isinstance(known, NoCudaRuntimeFilter)]
    record = logging.LogRecord(cpp_extension.name, logging.WARNING, __file__, 1, "", None, None)
    record.msg, record.args = "No CUDA runtime is found, using CUDA_HOME='%s'", ("/usr/local",)
    assert not dropping.filter(record)
    record.msg, record.args = "Error checking compiler version for %s", ("c++",)
    assert dropping.filter(record)
    assert compile_mode(to_train_config(compose_config("compile=true")), torch.device("cpu")) == "default"


def test_conv_bias_false_removes_biases_before_batchnorm():
    from trainer.config import ModelConfig, ModelName

    with_bias = build_model(ModelConfig(name=ModelName.resnet18, conv_bias=True), 10)
    without = build_model(ModelConfig(name=ModelName.resnet18, conv_bias=False), 10)
    convs = [m for m in without.modules() if isinstance(m, nn.Conv2d)]
    assert convs and all(m.bias is None for m in convs)
    assert all(m.bias is not None for m in with_bias.modules() if isinstance(m, nn.Conv2d))
    parameters = sum(p.numel() for p in with_bias.parameters()) - sum(p.numel() for p in without.parameters())
    assert parameters == sum(m.out_channels for m in convs)


def test_grad_checkpointing_recomputes_stages_with_the_same_gradients():
    from trainer.config import ModelConfig, ModelName

    torch.manual_seed(0)
    plain = build_model(ModelConfig(name=ModelName.resnet18), 10)
    checkpointed = build_model(ModelConfig(name=ModelName.resnet18, grad_checkpointing=True), 10)
    checkpointed.load_state_dict(plain.state_dict())
    assert all(isinstance(getattr(checkpointed, f"layer{i}"), CheckpointedStage) for i in range(1, 5))
    calls = []
    checkpointed.layer2[0].register_forward_hook(lambda *_: calls.append(1))
    images = torch.randn(4, 3, 32, 32)
    for model in (plain, checkpointed):
        model(images).sum().backward()
    assert len(calls) == 2  # forward, then again in backward
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)


def coordinate_images(count: int) -> torch.Tensor:
    """Images whose pixels say where they are: channel 0 = row + 1, channel 1 = column + 1,
    channel 2 = image index; zero padding therefore shows as 0."""
    rows = torch.arange(32).view(32, 1).expand(32, 32) + 1
    cols = torch.arange(32).view(1, 32).expand(32, 32) + 1
    images = torch.stack([rows, cols, torch.zeros(32, 32, dtype=torch.long)]).repeat(count, 1, 1, 1)
    images[:, 2] = torch.arange(count).view(count, 1, 1)
    return images.to(torch.uint8)


def coordinate_loaders(
    count: int,
    batch_size: int,
    cutout: int = 0,
    crop_flip: CropFlip = DEFAULT_CROP_FLIP,
    device: str = "cpu",
    **kwargs,
) -> dict:
    """Both loaders over the same coordinate images (uint8 batches, not yet normalized); the
    GPU-resident one on `device`."""
    images = coordinate_images(count)
    splits = Splits(ImageSplit(torch.arange(count), images), ImageSplit(torch.arange(count), images), [])
    common = dict(
        augment=True, batch_size=batch_size, seed=0, rank=0, world_size=1, cutout=cutout, crop_flip=crop_flip
    )
    train_gpu, _ = gpu_loaders(splits, device=torch.device(device), **common)
    train_torch, _ = torch_loaders(splits, loader_kwargs=kwargs, **common)
    return {"gpu": train_gpu, "torch": train_torch}


@pytest.mark.parametrize("kind", ["gpu", "torch"])
def test_loader_augmentation_statistics(kind):
    count = 2000
    loader = coordinate_loaders(count, 250)[kind]
    shifts, flips, seen = [], [], []
    for images, labels in loader:
        pixels = images.long()
        assert torch.equal(pixels[:, 2, 16, 16], labels % 256)  # images stay with their labels
        seen.append(labels)
        center_row = pixels[:, 0, :, 16]  # row + 1 of the source, 0 in padding
        # the crop's top row in source coordinates: the first nonzero row minus its position
        top = torch.stack([(r[r > 0][0] - 1) - (r > 0).nonzero()[0, 0] for r in center_row])
        center_col = pixels[:, 1, 16, :]
        flipped = torch.stack([(c[c > 0].diff() < 0).all() for c in center_col])
        shifts.append(top)
        flips.append(flipped)
    shifts, flips = torch.cat(shifts), torch.cat(flips)
    assert set(shifts.tolist()) == set(range(-4, 5))
    assert 0.45 < flips.float().mean().item() < 0.55
    assert torch.equal(torch.cat(seen).sort().values, torch.arange(count))  # a permutation


@pytest.mark.parametrize("padding_mode", ["constant", "reflect"])
def test_both_loaders_give_the_same_batches_whatever_the_worker_count(padding_mode):
    crop_flip = CropFlip(padding_mode=padding_mode)
    loaders = coordinate_loaders(600, 100, cutout=12, crop_flip=crop_flip, num_workers=2)
    for epoch in (0, 3):
        for loader in loaders.values():
            loader.set_epoch(epoch, skip_batches=1)
        gpu, torch_path = list(loaders["gpu"]), list(loaders["torch"])
        assert len(gpu) == len(torch_path) == 5
        for (gpu_images, gpu_labels), (images, labels) in zip(gpu, torch_path):
            assert torch.equal(gpu_images, images) and torch.equal(gpu_labels, labels)
    in_process = coordinate_loaders(600, 100, cutout=12, crop_flip=crop_flip)["torch"]
    in_process.set_epoch(3, skip_batches=1)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(in_process, torch_path))


def reference_crops(images: np.ndarray, padding: int, mode: str, draws: tuple) -> np.ndarray:
    """Each image padded by np.pad in `mode`, cropped at its drawn (top, left), mirrored where
    drawn: the crops, one image at a time."""
    sides = (padding, padding)
    padded = np.pad(images, ((0, 0), (0, 0), sides, sides), mode=mode)
    crops = [image[:, y : y + 32, x : x + 32] for image, y, x in zip(padded, *draws[:2])]
    return np.stack([crop[..., ::-1] if mirrored else crop for crop, mirrored in zip(crops, draws[2])])


@pytest.mark.parametrize("mode", ["constant", "reflect"])
def test_padding_mode_fills_the_crops_border_with_zeros_or_the_mirrored_image(mode):
    """A crop at the top (bottom) offset starts (ends) with 4 rows of padding: zeros, or source
    rows 4..1 (30..27), mirrored about the edge row, which is not repeated. Both loaders."""
    count, crop_flip = 256, CropFlip(4, padding_mode=mode)
    loaders = coordinate_loaders(count, count, crop_flip=crop_flip)
    [(images, labels)], [(torch_images, torch_labels)] = list(loaders["gpu"]), list(loaders["torch"])
    assert torch.equal(images, torch_images) and torch.equal(labels, torch_labels)
    draws = crop_flip.draw(0, 0, labels.numpy())
    rows = images[:, 0, :, 16]  # channel 0: the source row + 1, 0 in zero padding
    above, below = ([5, 4, 3, 2], [31, 30, 29, 28]) if mode == "reflect" else ([0] * 4, [0] * 4)
    at_top, at_bottom = rows[draws[0] == 0], rows[draws[0] == 8]
    assert len(at_top) and len(at_bottom)
    assert (at_top[:, :4] == torch.tensor(above)).all() and (at_bottom[:, -4:] == torch.tensor(below)).all()
    expected = reference_crops(coordinate_images(count).numpy()[labels], 4, mode, draws)
    assert np.array_equal(images.numpy(), expected)


def test_data_padding_mode_reflect_reaches_the_training_crops_at_the_widest_padding(tmp_path):
    trainer = built(tmp_path, "data.padding_mode=reflect", "data.crop_padding=16")
    loader = trainer.train_loader
    loader.set_epoch(1)
    images, _ = next(iter(loader))
    index = loader.sampler.epoch_indices()[: len(images)]
    draws = loader.dataset.crop_flip.draw(trainer.cfg.seed, 1, index)
    expected = reference_crops(loader.dataset.images[index], 16, "reflect", draws)
    assert np.array_equal(images.numpy(), expected)


def test_cutout_blanks_a_square_of_the_mean_colour_anywhere_in_the_image():
    size = 12
    [(images, _)] = list(coordinate_loaders(400, 400, cutout=size)["gpu"])
    blanked = images[:, 0] == CUTOUT_FILL[0]  # channel 0 holds rows 1..32 elsewhere
    assert torch.equal(blanked, images[:, 1] == CUTOUT_FILL[1])  # every channel, the same square
    rows, cols = blanked.any(dim=2), blanked.any(dim=1)
    heights, widths = rows.sum(dim=1), cols.sum(dim=1)
    assert torch.equal(blanked.sum(dim=(1, 2)), heights * widths)  # a rectangle
    assert heights.max() == size and widths.max() == size and heights.min() < size  # clipped at edges
    assert rows[:, 0].any() and rows[:, -1].any() and cols[:, 0].any() and cols[:, -1].any()
    unaugmented = coordinate_loaders(400, 400)["gpu"]
    [(plain, _)] = list(unaugmented)
    assert torch.equal(torch.where(blanked[:, None], plain, images), plain)  # only the square changes


def test_crop_and_flip_picks_the_window():
    padded = torch.arange(2 * 40 * 40).view(2, 1, 40, 40)
    out = crop_and_flip(padded, torch.tensor([1]), torch.tensor([3]), torch.tensor([5]), torch.tensor([True]))
    torch.testing.assert_close(out[0, 0], padded[1, 0, 3:35, 5:37].flip(1))


def test_gpu_loader_on_cpu_is_selected_and_says_so(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    trainer = built(tmp_path, "data.loader=gpu", "max_steps=2")
    assert isinstance(trainer.train_loader, GpuLoader)
    assert trainer.fit()["steps"] == 2
    assert "data.loader=gpu has no effect here" in caplog.text


def test_profile_writes_a_trace_and_logs_top_ops(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    trainer = built(tmp_path, "profile=true", "data.train_size=512")
    trainer.fit()
    traces = list((tmp_path / "run" / "profile").glob("*.pt.trace.json"))
    assert len(traces) == 1 and traces[0].stat().st_size > 1000
    assert "profile: top ops" in caplog.text and "aten::" in caplog.text
    assert f"trace {traces[0]} (open it in https://ui.perfetto.dev" in caplog.text  # where, and how


def test_data_wait_is_measured_and_a_slow_pipeline_gets_a_hint(tmp_path, caplog):
    import time

    caplog.set_level(logging.INFO)
    trainer = built(tmp_path, "log_every=100", "max_steps=8")
    batches, slept = trainer.train_batches, []

    class Slow:
        """Hands over each batch only after four times as long as the step before it took: the
        loop waits for data ~4/5 of the epoch however fast or loaded the machine is (a fixed
        sleep would be outrun by a slow, busy machine's steps)."""

        def __len__(self):
            return len(batches)

        def __iter__(self):
            handed_over = None
            for batch in batches:
                if handed_over is not None:
                    step = time.perf_counter() - handed_over
                    started = time.perf_counter()
                    time.sleep(4 * step)
                    slept.append(time.perf_counter() - started)
                handed_over = time.perf_counter()
                yield batch

    trainer.train_batches = Slow()
    metrics = trainer.fit()
    [epoch] = metrics["history"]
    assert len(slept) == 7  # before every batch but the first
    assert epoch["data_wait_frac"] * epoch["epoch_s"] >= sum(slept) * (1 - 1e-9)  # every wait is counted
    assert metrics["data_wait_frac"] > 0.5
    assert "waited for data: try more num_workers" in caplog.text
    off = Trainer(compose_config("measure_data_wait=false", "max_steps=2"), tmp_path / "off").fit()
    assert off["data_wait_frac"] is None


def test_the_console_goes_quiet_only_for_a_stream_that_cannot_be_written(capsys):
    """A format error in a log call is logging's to report; the handler stays on."""
    import io

    from trainer.console import ConsoleHandler

    stream = io.StringIO()
    handler = ConsoleHandler(stream)
    handler.handle(logging.LogRecord("x", logging.INFO, __file__, 1, "%d", ("not a number",), None))
    assert not handler.silenced and "--- Logging error ---" in capsys.readouterr().err
    handler.handle(logging.LogRecord("x", logging.INFO, __file__, 1, "fine", None, None))
    assert stream.getvalue() == "fine\n"


def test_the_evaluation_uses_cudnns_heuristics_where_the_training_autotunes(tmp_path, monkeypatch):
    gpu = torch.device("cuda", 0)  # only its type is read: no CUDA needed
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    assert perf.evaluation_backend(gpu) is contextlib.nullcontext  # nothing autotunes
    trainer = built(tmp_path, "cudnn_benchmark=true", "data.train_size=64", "data.test_size=32")
    assert trainer.parts.evaluation_backend is contextlib.nullcontext  # a CPU has no cuDNN
    assert torch.backends.cudnn.benchmark
    trainer.parts.evaluation_backend = perf.evaluation_backend(gpu)  # as on a GPU
    seen = []
    trainer.parts.raw_model.register_forward_hook(lambda *_: seen.append(torch.backends.cudnn.benchmark))
    trainer.evaluate()
    assert seen and not any(seen)
    assert torch.backends.cudnn.benchmark  # the training's autotuning back after it


def test_compile_works_out_inductors_cache_keys_beside_the_set_up(monkeypatch):
    from torch._inductor import codecache

    from trainer.perf import compile_keys

    threads = []

    def key() -> bytes:
        threads.append(threading.current_thread().name)
        return b"key"

    for name in compile_keys.INDUCTOR_CACHE_KEYS:  # a torch without prefetch(): before 2.13
        monkeypatch.setattr(codecache, name, key)
    perf.cache_keys_ahead(to_train_config(compose_config("compile=false")))()
    assert threads == []
    perf.cache_keys_ahead(to_train_config(compose_config("compile=true")))()  # waits for the thread
    assert threads == ["inductor-cache-keys"] * len(compile_keys.INDUCTOR_CACHE_KEYS)

    prefetched = []
    key.prefetch = lambda: prefetched.append(1)  # torch 2.13 and later: torch's own thread
    perf.cache_keys_ahead(to_train_config(compose_config("compile=true")))()
    assert len(prefetched) == len(compile_keys.INDUCTOR_CACHE_KEYS)
    assert len(threads) == len(compile_keys.INDUCTOR_CACHE_KEYS)  # none of ours

    # torch before 2.13: inductor's cache module has no triton_key, torch asks triton's own
    pytest.importorskip("triton")
    import triton.runtime.cache

    monkeypatch.delattr(codecache, "triton_key")
    monkeypatch.setattr(codecache, "torch_key", lambda: threads.append("torch") or b"key")
    monkeypatch.setattr(triton.runtime.cache, "triton_key", lambda: threads.append("triton") or "key")
    threads.clear()
    perf.cache_keys_ahead(to_train_config(compose_config("compile=true")))()
    assert sorted(threads) == ["torch", "triton"]


def test_the_warm_up_waits_for_the_cache_keys_before_its_first_step(tmp_path, monkeypatch):
    from trainer import loop, warm_up

    trainer = built(tmp_path, "data.train_size=64", "data.test_size=32", "batch_size=32")
    order = []
    trainer.parts.warm_up_steps = 1  # as where it compiles
    trainer.parts.cache_keys_ready = lambda: order.append("keys")
    steps = loop.forward_backward
    monkeypatch.setattr(loop, "forward_backward", lambda *a, **k: order.append("step") or steps(*a, **k))
    warm_up.warm_up(trainer.parts, 0)
    assert order[:2] == ["keys", "step"]


def test_the_warm_up_evaluates_the_first_and_the_last_test_batch_only(tmp_path, monkeypatch):
    """The two shapes the evaluation runs at (a full batch, the partial last one), not every batch."""
    from trainer import evaluation, warm_up

    trainer = built(tmp_path, "data.train_size=64", "data.test_size=72", "batch_size=32")
    trainer.parts.warm_up_steps = 1
    seen = []
    monkeypatch.setattr(evaluation, "evaluate", lambda model, batches, *a: seen.append(list(batches)) or {})
    warm_up.warm_up(trainer.parts, 0)
    [batches] = seen
    every = list(trainer.parts.test_batches)
    assert [len(labels) for _, labels in every] == [32, 32, 8]
    assert len(batches) == 2
    for (images, labels), (expected_images, expected_labels) in zip(batches, [every[0], every[-1]]):
        assert torch.equal(images, expected_images) and torch.equal(labels, expected_labels)
    assert warm_up.first_and_last([]) == [] and warm_up.first_and_last(["a"]) == ["a"]
    assert warm_up.first_and_last(iter("abc")) == ["a", "c"]


def test_cuda_is_started_ahead_only_on_cuda_and_not_under_deterministic(monkeypatch):
    from trainer.perf import cuda_start

    started = []
    monkeypatch.setattr(cuda_start, "start_cuda", lambda *arguments: started.append(arguments))
    cfg = to_train_config(compose_config("amp=true"))
    assert cuda_start.cuda_ahead(cfg, torch.device("cpu"), lambda: None) is cuda_start.nothing_to_wait_for
    deterministic = to_train_config(compose_config("deterministic=true"))
    assert (
        cuda_start.cuda_ahead(deterministic, torch.device("cuda"), lambda: None)
        is cuda_start.nothing_to_wait_for
    )
    assert started == []
    cuda_start.cuda_ahead(cfg, torch.device("cuda", 1), lambda: torch.bfloat16)()  # joined: it ran
    ((device, dtype, layout),) = started
    assert (
        device == torch.device("cuda", 1) and dtype() is torch.bfloat16 and layout is perf.memory_format(cfg)
    )


def test_two_starts_of_cuda_in_one_process_run_one_after_the_other(monkeypatch):
    """A worker's start on its home GPU and its first job's own start: the second waits, then
    finds the libraries loaded, instead of loading them beside the first."""
    import threading
    import time

    from trainer.perf import cuda_start

    events = []

    def start(device, dtype, layout):
        events.append(("in", device))
        time.sleep(0.2)  # the second start, begun meanwhile, would come in here without the lock
        events.append(("out", device))

    monkeypatch.setattr(cuda_start, "_start_cuda", start)
    home = threading.Thread(target=cuda_start.start_cuda, args=("home", None, None))
    home.start()
    while not events:
        time.sleep(0.005)
    cuda_start.start_cuda("job", None, None)
    home.join()
    assert events == [("in", "home"), ("out", "home"), ("in", "job"), ("out", "job")]


def test_a_device_is_made_current_without_starting_cuda_where_it_would_be_current_anyway(monkeypatch):
    """cuda:0 before CUDA's start is current once it starts: making it current would start CUDA
    on the main thread, ahead of the thread that starts it beside the set-up's imports."""
    from trainer.perf import cuda_start

    made, started = [], [False]
    monkeypatch.setattr(torch.cuda, "set_device", made.append)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: started[0])
    cuda_start.make_current(torch.device("cuda", 0))
    cuda_start.make_current(torch.device("cuda"))  # no index: the current one
    assert made == []
    cuda_start.make_current(torch.device("cuda", 1))
    started[0] = True
    cuda_start.make_current(torch.device("cuda", 0))  # CUDA started: another may be current
    assert made == [torch.device("cuda", 1), torch.device("cuda", 0)]


def test_the_assembly_waits_for_cuda_s_start_before_it_hands_its_parts_on(tmp_path, monkeypatch):
    order = []
    monkeypatch.setattr(perf, "cuda_ahead", lambda cfg, device, dtype: lambda: order.append("cuda started"))
    steps = perf.step_graph_acts
    monkeypatch.setattr(perf, "step_graph_acts", lambda *a: order.append("model") or steps(*a))
    trainer = built(tmp_path, "data.train_size=64", "data.test_size=32", "batch_size=32")
    assert order == ["model", "cuda started"] and trainer.parts is not None
