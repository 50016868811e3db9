"""cuDNN's autotuning begun ahead (trainer/perf/autotune_ahead.py): the thread trains a copy of
the model built on the meta device, so the run's random numbers are as without it. Its timing
itself happens only on CUDA; here the thread runs on the CPU in its place."""

import subprocess

import pytest
import torch
from conftest import run_python
from torch import nn

from trainer.perf import autotune_ahead


@pytest.fixture(autouse=True)
def nothing_timed_yet(monkeypatch):
    monkeypatch.setattr(autotune_ahead, "_timed", set())


def small_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )


def test_a_copy_built_on_the_meta_device_trains_without_a_random_draw(monkeypatch):
    trained = []
    real_train_once = autotune_ahead.train_once
    monkeypatch.setattr(autotune_ahead, "autotunes", lambda device: True)
    monkeypatch.setattr(autotune_ahead, "train_once", lambda *args: trained.append(real_train_once(*args)))
    copies = []

    def build() -> nn.Module:
        model = small_model()
        copies.append((model, next(model.parameters()).device.type))
        return model

    rng = torch.get_rng_state()
    shapes = autotune_ahead.shapes_to_time(4, 32, low_res=24, low_res_epochs=2)
    autotune_ahead.begin(build, torch.device("cpu"), shapes, lambda: None, torch.channels_last, ("a",))
    autotune_ahead.wait()
    assert len(trained) == 1
    autotune_ahead.begin(build, torch.device("cpu"), shapes, lambda: None, torch.channels_last, ("a",))
    autotune_ahead.wait()
    assert len(trained) == 1  # the same settings again (a sweep's next job): timed already
    model, built_on = copies[0]
    assert built_on == "meta"
    assert torch.equal(torch.get_rng_state(), rng)  # nothing drawn
    assert model[0].weight.grad is not None  # the copy stepped (to_empty gives it memory in place)


def test_a_model_the_meta_device_cannot_build_starts_nothing(monkeypatch):
    monkeypatch.setattr(autotune_ahead, "autotunes", lambda device: True)

    def build() -> nn.Module:
        raise RuntimeError("user code that needs real tensors")

    autotune_ahead.begin(
        build, torch.device("cpu"), [(2, 3, 8, 8)], lambda: None, torch.contiguous_format, ("b",)
    )
    assert autotune_ahead._running is None


def test_shapes_are_each_training_size():
    assert autotune_ahead.shapes_to_time(512, 32, 0, 0) == [(512, 3, 32, 32)]
    assert autotune_ahead.shapes_to_time(512, 32, 24, 3) == [(512, 3, 24, 24), (512, 3, 32, 32)]


def test_nothing_starts_where_cudnn_does_not_autotune():
    autotune_ahead.begin(
        small_model, torch.device("cpu"), [(2, 3, 8, 8)], lambda: None, torch.contiguous_format, ("c",)
    )
    assert autotune_ahead._running is None


def test_the_copy_runs_in_the_runs_precision_without_autocast(monkeypatch):
    """autocast's cache is one for the process under one lock, which its exit in this thread
    held while waiting for Python's lock: the main thread, tracing under autocast, deadlocked."""
    monkeypatch.setattr(autotune_ahead, "autotunes", lambda device: True)
    seen, copies = [], []

    def build() -> nn.Module:
        model = small_model()
        for layer in model[:2]:  # the convolution, then its batch norm
            layer.register_forward_pre_hook(
                lambda module, inputs: seen.append(
                    (inputs[0].dtype, module.weight.dtype, torch.is_autocast_enabled("cpu"))
                )
            )
        copies.append(model)
        return model

    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    autotune_ahead.begin(build, cpu, [(2, 3, 8, 8)], lambda: bf16, torch.channels_last, ("d",))
    autotune_ahead.wait()
    # as autocast runs them: the convolution's weight cast, batch norm's left in fp32
    assert seen == [(torch.bfloat16, torch.bfloat16, False), (torch.bfloat16, torch.float32, False)]
    assert copies[0][0].weight.grad is not None  # its backward ran, in that dtype


# As dynamo traces a model under autocast (fake tensors through Python's dispatcher, which holds
# Python's lock as it calls autocast's cache), while the thread trains its copy again and again.
RACE = """
import threading, torch
from torch import nn
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensorMode
from trainer.perf import autotune_ahead

def deep():
    return nn.Sequential(*[nn.Conv2d(4, 4, 1) for _ in range(16)], nn.Flatten(), nn.Linear(64, 10))

stop = threading.Event()
def again_and_again():
    while not stop.is_set():
        with torch.device("meta"):
            twin = deep()
        shapes, bf16 = [(2, 4, 4, 4)], torch.bfloat16
        autotune_ahead.train_once(twin, torch.device("cpu"), shapes, lambda: bf16, torch.contiguous_format)

thread = threading.Thread(target=again_and_again)
thread.start()
model, fake = deep(), FakeTensorMode(allow_non_fake_inputs=True)
images = fake.from_tensor(torch.zeros(2, 4, 4, 4))
for _ in range(150):
    with fake, enable_python_dispatcher(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(images)
stop.set()
thread.join()
print("done")
"""


def test_the_thread_never_deadlocks_a_main_thread_tracing_under_autocast():
    """With the copy under autocast, every such run on the 2-core CPU hung (8 of 8, within the
    first 100 passes where counted), as 2 of 17 ResNet-18 warm-ups did on an H200."""
    try:
        done = run_python(RACE)
    except subprocess.TimeoutExpired:
        pytest.fail("the main thread and the autotuning thread deadlocked (autocast's cache lock)")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "done"
