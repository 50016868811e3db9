"""cuDNN's autotuning done ahead (trainer/perf/autotune_ahead.py): a copy of the model built on
the meta device trains one step, its forward on the calling thread while the data is built in
another, its backward from a thread, so the run's random numbers are as without it. Its timing
itself happens only on CUDA; here the copy runs on the CPU in its place."""

import subprocess
import threading

import pytest
import torch
from conftest import run_python
from torch import nn

from trainer.perf import autotune_ahead


@pytest.fixture(autouse=True)
def nothing_timed_yet(monkeypatch):
    monkeypatch.setattr(autotune_ahead, "_timed", set())


def small_model(classes: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, classes),
    )


def beside(work, build, shapes=((2, 3, 8, 8),), dtype=None, layout=torch.contiguous_format, settings=("a",)):
    cpu = torch.device("cpu")
    return autotune_ahead.beside(work, build, cpu, list(shapes), lambda: dtype, layout, settings)


def test_a_copy_built_on_the_meta_device_trains_without_a_random_draw(monkeypatch):
    monkeypatch.setattr(autotune_ahead, "autotunes", lambda device: True)
    copies = []

    def build(classes: int) -> nn.Module:
        model = small_model(classes)
        copies.append((model, next(model.parameters()).device.type))
        return model

    rng = torch.get_rng_state()
    shapes = autotune_ahead.shapes_to_time(4, 32, low_res=24, low_res_epochs=2)
    assert beside(lambda: "data", build, shapes, layout=torch.channels_last) == "data"
    autotune_ahead.wait()
    assert beside(lambda: "again", build, shapes, layout=torch.channels_last) == "again"
    assert len(copies) == 1  # the same settings again (a sweep's next job): timed already
    model, built_on = copies[0]
    assert built_on == "meta"
    assert torch.equal(torch.get_rng_state(), rng)  # nothing drawn
    assert model[0].weight.grad is not None  # the copy stepped (to_empty gives it memory in place)


def test_the_data_is_built_in_a_thread_beside_the_forward_and_the_backward_follows_in_another(monkeypatch):
    """cuDNN keeps its timings per thread: the forward's on the thread the run's forward passes
    run on (this one); the backward's on autograd's, from whichever thread calls it."""
    monkeypatch.setattr(autotune_ahead, "autotunes", lambda device: True)
    threads, copies = {}, []
    here = threading.current_thread()

    def build(classes: int) -> nn.Module:
        model = small_model(classes)
        model[0].register_forward_hook(lambda *_: threads.update(forward=threading.current_thread()))
        copies.append(model)
        return model

    def work() -> str:
        threads["work"] = threading.current_thread()
        return "data"

    assert beside(work, build) == "data"
    backward = autotune_ahead._running
    autotune_ahead.wait()
    assert threads["forward"] is here and threads["work"] not in (here, backward)
    assert backward is not None and copies[0][0].weight.grad is not None


def test_what_the_data_raises_is_raised_here_and_no_backward_begins(monkeypatch):
    monkeypatch.setattr(autotune_ahead, "autotunes", lambda device: True)

    def work():
        raise ValueError("batch_size larger than the data")

    with pytest.raises(ValueError, match="larger than the data"):
        beside(work, small_model, settings=("e",))
    assert autotune_ahead._running is None
    assert ("e",) not in autotune_ahead._timed  # a sweep's next job with these settings times them


def test_a_forward_that_fails_at_a_later_shape_keeps_the_shapes_done(monkeypatch):
    monkeypatch.setattr(autotune_ahead, "autotunes", lambda device: True)
    shapes = [(2, 3, 8, 8), (2, 3, 9, 9)]

    def build(classes: int) -> nn.Module:
        model = small_model(classes)
        model[0].register_forward_pre_hook(lambda module, inputs: 1 / 0 if inputs[0].shape[-1] == 9 else None)
        return model

    twin = autotune_ahead.meta_copy(build)
    losses = autotune_ahead.forward_passes(
        twin, torch.device("cpu"), shapes, lambda: None, torch.contiguous_format
    )
    assert len(losses) == 1  # the 9x9 pass raised; the 8x8 one's backward can still be timed


def test_a_cuda_device_without_index_is_the_callers_current_one():
    assert autotune_ahead.with_index(torch.device("cpu")) == torch.device("cpu")
    assert autotune_ahead.with_index(torch.device("cuda", 1)) == torch.device("cuda", 1)
    if not torch.cuda.is_initialized():  # before CUDA starts, every thread's current device is 0
        assert autotune_ahead.with_index(torch.device("cuda")) == torch.device("cuda", 0)


def test_a_model_the_meta_device_cannot_build_leaves_the_data_to_this_thread(monkeypatch):
    monkeypatch.setattr(autotune_ahead, "autotunes", lambda device: True)

    def build(classes: int) -> nn.Module:
        raise RuntimeError("user code that needs real tensors")

    assert beside(threading.current_thread, build, settings=("b",)) is threading.current_thread()
    assert autotune_ahead._running is None


def test_shapes_are_each_training_size():
    assert autotune_ahead.shapes_to_time(512, 32, 0, 0) == [(512, 3, 32, 32)]
    assert autotune_ahead.shapes_to_time(512, 32, 24, 3) == [(512, 3, 24, 24), (512, 3, 32, 32)]


def test_nothing_is_timed_where_cudnn_does_not_autotune():
    built, here = [], threading.current_thread()
    assert beside(threading.current_thread, lambda: built.append(1), settings=("c",)) is here
    assert autotune_ahead._running is None and not built


def test_the_copy_runs_in_the_runs_precision_without_autocast(monkeypatch):
    """autocast's cache is one for the process under one lock, which its exit in the thread
    held while waiting for Python's lock: the main thread, tracing under autocast, deadlocked."""
    monkeypatch.setattr(autotune_ahead, "autotunes", lambda device: True)
    seen, copies = [], []

    def build(classes: int) -> nn.Module:
        model = small_model(classes)
        for layer in model[:2]:  # the convolution, then its batch norm
            layer.register_forward_pre_hook(
                lambda module, inputs: seen.append(
                    (inputs[0].dtype, module.weight.dtype, torch.is_autocast_enabled("cpu"))
                )
            )
        copies.append(model)
        return model

    beside(lambda: None, build, dtype=torch.bfloat16, layout=torch.channels_last, settings=("d",))
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
        shapes, bf16, cpu = [(2, 4, 4, 4)], torch.bfloat16, torch.device("cpu")
        losses = autotune_ahead.forward_passes(twin, cpu, shapes, lambda: bf16, torch.contiguous_format)
        autotune_ahead.backward_passes(losses, cpu)

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
