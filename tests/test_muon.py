"""optim=muon: torch.optim.Muon steps the convolution weights (seen as matrices, in any memory
layout), SGD the rest, as one optimizer that schedulers, checkpoints and resumes treat as any."""

from __future__ import annotations

import logging
import re
from dataclasses import replace

import pytest
import torch
from conftest import assert_resumes_exactly, compose_config
from torch import nn

from trainer import Trainer
from trainer.config import ConfigError, OptimConfig, OptimizerName, TrainerError, to_train_config
from trainer.muon import MuonWithSgd
from trainer.muon_arithmetic import momentum_directions, orthogonalized, same_shapes
from trainer.optim import build_optimizer, build_scheduler
from trainer.perf import optimizer_compiler
from trainer.perf.graphed import CudaGraphed

MUON = OptimConfig(name=OptimizerName.muon, lr=0.1, momentum=0.9, muon_lr=0.05, muon_momentum=0.9)


def small_net(channels_last: bool = False) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 4, 3),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 10),
    )
    return net.to(memory_format=torch.channels_last) if channels_last else net


def train_steps(net: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3) -> None:
    torch.manual_seed(1)
    for _ in range(steps):
        images = torch.randn(4, 3, 8, 8)
        if not next(net.parameters()).is_contiguous():
            images = images.to(memory_format=torch.channels_last)
        nn.functional.cross_entropy(net(images), torch.arange(4)).backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize(("weight_decay", "ns_steps"), [(0.0, 5), (0.1, 5), (0.0, 3)])
def test_the_convolutions_take_torchs_muon_step_and_the_rest_sgds(weight_decay, ns_steps):
    """The Muon step written out in trainer/muon.py against torch.optim.Muon itself."""
    net, reference = small_net(), small_net()
    settings = replace(MUON, muon_weight_decay=weight_decay, muon_ns_steps=ns_steps)
    optimizer = build_optimizer(settings, net, {}, lr=0.1)
    assert isinstance(optimizer, MuonWithSgd)
    train_steps(net, optimizer)
    # The same steps by hand: each conv weight as a (out, fan-in) parameter under torch.optim.Muon
    convs = [module for module in reference if isinstance(module, nn.Conv2d)]
    matrices = [nn.Parameter(conv.weight.detach().reshape(len(conv.weight), -1).clone()) for conv in convs]
    muon = torch.optim.Muon(
        matrices, lr=0.05, momentum=0.9, nesterov=True, weight_decay=weight_decay, ns_steps=ns_steps
    )
    others = [
        param
        for name, param in reference.named_parameters()
        if not (name.endswith("weight") and param.ndim == 4)
    ]
    sgd = torch.optim.SGD(others, lr=0.1, momentum=0.9, nesterov=True, weight_decay=MUON.weight_decay)

    class Both:
        def step(self):
            for conv, matrix in zip(convs, matrices):
                matrix.grad = conv.weight.grad.reshape(matrix.shape)
            sgd.step()
            muon.step()
            for conv, matrix in zip(convs, matrices):
                conv.weight.data.copy_(matrix.data.reshape(conv.weight.shape))

        def zero_grad(self):
            reference.zero_grad()

    train_steps(reference, Both())
    for (name, trained), expected in zip(net.named_parameters(), reference.parameters()):
        torch.testing.assert_close(trained, expected, rtol=0, atol=0, msg=name)  # op for op
    assert not torch.equal(net[0].weight, small_net()[0].weight)
    if ns_steps != 5:  # the setting took effect: torch's default of 5 steps to other weights
        default = small_net()
        train_steps(default, build_optimizer(replace(settings, muon_ns_steps=5), default, {}, lr=0.1))
        assert not torch.equal(net[0].weight, default[0].weight)


def test_channels_last_weights_take_the_same_steps():
    """Muon sees a channels_last weight's matrix with its columns in another order: the update is
    the same, to the precision of Muon's bf16 iteration."""
    plain, last = small_net(), small_net(channels_last=True)
    train_steps(plain, build_optimizer(MUON, plain, {}, lr=0.1))
    train_steps(last, build_optimizer(MUON, last, {}, lr=0.1))
    assert last[0].weight.is_contiguous(memory_format=torch.channels_last)
    for (name, expected), trained in zip(plain.named_parameters(), last.parameters()):
        torch.testing.assert_close(trained, expected, atol=2e-3, rtol=0, msg=name)


def test_fixed_norm_rescales_each_convolution_weight_before_muons_step():
    """optim.muon_fixed_norm: the step is Muon's, taken from each weight rescaled to a Frobenius
    norm of sqrt(output channels); the gradient is the one the unscaled weights gave."""
    net, reference = small_net(), small_net()
    train_steps(net, build_optimizer(replace(MUON, muon_fixed_norm=True), net, {}, lr=0.1), steps=1)

    plain = build_optimizer(MUON, reference, {}, lr=0.1)
    torch.manual_seed(1)
    nn.functional.cross_entropy(reference(torch.randn(4, 3, 8, 8)), torch.arange(4)).backward()
    with torch.no_grad():
        for conv in (module for module in reference if isinstance(module, nn.Conv2d)):
            conv.weight.mul_(len(conv.weight) ** 0.5 / conv.weight.norm())
    plain.step()
    for (name, trained), expected in zip(net.named_parameters(), reference.parameters()):
        torch.testing.assert_close(trained, expected, msg=name)

    still = small_net()  # at muon_lr 0 only the rescale shows
    rescale_only = replace(MUON, muon_lr=0.0, muon_fixed_norm=True)
    train_steps(still, build_optimizer(rescale_only, still, {}, lr=0.1), steps=1)
    for conv in (module for module in still if isinstance(module, nn.Conv2d)):
        assert conv.weight.norm().item() ** 2 == pytest.approx(len(conv.weight), rel=1e-5)


@pytest.mark.parametrize("shape", [(8, 27), (27, 8)])  # wide, and tall (orthogonalized transposed)
def test_weights_of_one_shape_are_orthogonalized_together_as_each_would_be_alone(shape):
    torch.manual_seed(0)
    grads = [torch.randn(*shape) for _ in range(3)] + [torch.randn(5, 7)]
    buffers = [torch.randn_like(grad) for grad in grads]
    settings = (0.6, True, (3.4445, -4.775, 2.0315), 3, 1e-7)

    new_buffers, updates = orthogonalized(grads, buffers, *settings)

    assert same_shapes(grads) == [[0, 1, 2], [3]]
    for grad, buffer, new_buffer, update in zip(grads, buffers, new_buffers, updates, strict=True):
        [alone_buffer], [alone] = orthogonalized([grad], [buffer], *settings)
        assert torch.equal(new_buffer, alone_buffer) and update.shape == grad.shape
        torch.testing.assert_close(update, alone, atol=8e-3, rtol=0)  # bf16: a batched GEMM may round apart


def test_compile_true_compiles_muons_arithmetic_and_the_steps_stay_the_same():
    """compile=true hands the optimizer torch.compile (trainer/perf/model.py); the Muon part
    runs its whole arithmetic through what it was given, once per group and step."""
    assert optimizer_compiler(to_train_config(compose_config("compile=false")), torch.device("cpu")) is None
    compile_on = to_train_config(compose_config("optim=muon", "compile=true", "compile_mode=default"))
    assert callable(optimizer_compiler(compile_on, torch.device("cpu")))

    calls = []

    def recording(function):
        def wrapped(*args):
            calls.append(len(args[0]))  # the group's gradients, all in one call
            return function(*args)

        return wrapped

    net, reference = small_net(), small_net()
    train_steps(net, build_optimizer(MUON, net, {}, lr=0.1, compiler=recording))
    train_steps(reference, build_optimizer(MUON, reference, {}, lr=0.1))
    assert calls == [2, 2, 2]  # both convolutions, each of the 3 steps
    for (name, trained), expected in zip(net.named_parameters(), reference.parameters()):
        torch.testing.assert_close(trained, expected, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    ("model_mode", "step_mode"),
    [("reduce_overhead", "default"), ("max_autotune", "max-autotune-no-cudagraphs"), ("default", "default")],
)
def test_the_muon_step_compiles_without_cuda_graphs_of_its_own(monkeypatch, model_mode, step_mode):
    """Graphs of its own would overwrite the model's graph outputs the step still reads (a
    RuntimeError on the GPU, "accessing tensor output of CUDAGraphs that has been overwritten")."""
    modes = []
    monkeypatch.setattr(torch, "compile", lambda function, mode, dynamic: modes.append(mode) or function)
    settings = (
        "optim=muon",
        "compile=true",
        "compile_optimizer=true",
        f"compile_mode={model_mode}",
        "set_to_none=true",
    )
    wrapped = optimizer_compiler(to_train_config(compose_config(*settings)), torch.device("cuda"))(len)
    assert modes == [step_mode]
    # the modes that ask for CUDA graphs get them, in a graph of the step's own (graphed.py)
    assert isinstance(wrapped, CudaGraphed) == (model_mode != "default")


@pytest.mark.parametrize(
    ("settings", "compiled", "graphed"),
    [
        (("compile_mode=reduce_overhead", "set_to_none=true"), False, True),  # auto: the graph's replay
        (("compile_mode=default", "step_graph=true"), False, True),
        (("compile_mode=default",), True, False),  # auto: no graph replays it, compiled
        (("compile_mode=default", "compile_optimizer=false"), False, False),
        (("compile_mode=reduce_overhead", "set_to_none=true", "compile_optimizer=true"), True, True),
    ],
)
def test_compile_optimizer_says_whether_muons_arithmetic_is_compiled(
    monkeypatch, settings, compiled, graphed
):
    """auto compiles it unless a CUDA graph replays it; true and false decide either way."""
    modes = []
    monkeypatch.setattr(torch, "compile", lambda function, mode, dynamic: modes.append(mode) or function)
    compiler = optimizer_compiler(
        to_train_config(compose_config("optim=muon", "compile=true", *settings)), torch.device("cuda")
    )
    wrapped = compiler(len) if compiler else len
    assert bool(modes) == compiled
    assert isinstance(wrapped, CudaGraphed) == graphed


def test_compile_optimizer_without_muon_says_it_cannot_act(caplog):
    """Only optim=muon's arithmetic is ours to compile; a sweep over it and the optimizer runs."""
    cfg = to_train_config(compose_config("compile=true", "compile_optimizer=true"))
    with caplog.at_level(logging.INFO):
        assert optimizer_compiler(cfg, torch.device("cuda")) is None
    assert (
        "compile_optimizer=true has no effect here "
        "(it acts on optim=muon's arithmetic, this run has optim=sgd)" in caplog.text
    )


def test_compile_optimizer_takes_auto_true_or_false_only():
    with pytest.raises(
        ConfigError, match=re.escape("compile_optimizer must be auto, true or false (unquoted), got 1")
    ):
        to_train_config(compose_config("optim=muon", "compile_optimizer=1"))


@pytest.mark.parametrize("nesterov", [True, False])
def test_the_compiled_form_of_the_momentum_is_the_eager_one(nesterov):
    """Weight by weight where compiled (torch 2.11's inductor failed on the multi-tensor form),
    multi-tensor ops where eager: the same numbers."""
    torch.manual_seed(0)
    grads = [torch.randn(8, 27), torch.randn(16, 72), torch.randn(8, 27)]
    buffers = [torch.randn_like(grad) for grad in grads]
    eager = momentum_directions(grads, [b.clone() for b in buffers], 0.6, nesterov, eager=True)
    weight_by_weight = momentum_directions(grads, [b.clone() for b in buffers], 0.6, nesterov, eager=False)
    for eager_part, other_part in zip(eager, weight_by_weight):
        for a, b in zip(eager_part, other_part):
            assert torch.equal(a, b)


def test_the_muon_step_is_a_cuda_graph_where_the_run_asks_for_graphs_on_cuda():
    def compiler(device: str, *settings: str):
        return optimizer_compiler(to_train_config(compose_config(*settings)), torch.device(device))

    graphed = compiler("cuda", "compile=false", "step_graph=true")(len)
    assert isinstance(graphed, CudaGraphed) and graphed.function is len  # eager, replayed as a graph
    assert compiler("cuda", "compile=false") is None
    assert compiler("cpu", "compile=false", "step_graph=true") is None  # CUDA graphs need CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="reduce-overhead's CUDA graphs: needs a CUDA GPU")
def test_the_compiled_muon_step_on_a_gpu_matches_the_eager_one():
    settings = (
        "optim=muon",
        "compile=true",
        "compile_optimizer=true",
        "compile_mode=reduce_overhead",
        "set_to_none=true",
    )
    cfg = to_train_config(compose_config(*settings))
    compiler = optimizer_compiler(cfg, torch.device("cuda"))
    nets = [small_net().cuda(), small_net().cuda()]
    optimizers = [
        build_optimizer(MUON, nets[0], {}, lr=0.1, compiler=compiler),
        build_optimizer(MUON, nets[1], {}, lr=0.1),
    ]
    for net, optimizer in zip(nets, optimizers):
        torch.manual_seed(1)
        for _ in range(5):
            images = torch.randn(4, 3, 8, 8, device="cuda")
            nn.functional.cross_entropy(net(images), torch.arange(4, device="cuda")).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    for (name, compiled), eager in zip(nets[0].named_parameters(), nets[1].parameters()):
        torch.testing.assert_close(compiled, eager, atol=5e-3, rtol=0, msg=name)  # bf16, fused otherwise


def test_schedulers_set_both_optimizers_lr_and_a_checkpoint_round_trips():
    net = small_net()
    optimizer = build_optimizer(MUON, net, {}, lr=0.1)
    scheduler = build_scheduler(MUON, optimizer, total_steps=10)
    train_steps(net, optimizer)
    scheduler.step()
    assert [group["lr"] for group in optimizer.sgd.param_groups + optimizer.muon.param_groups] == [
        group["lr"] for group in optimizer.param_groups
    ]
    assert optimizer.muon.param_groups[0]["lr"] / optimizer.sgd.param_groups[0]["lr"] == pytest.approx(0.5)
    copy = build_optimizer(MUON, small_net(), {}, lr=0.1)
    copy.load_state_dict(optimizer.state_dict())
    assert len(copy.muon.state) == 2 and len(copy.sgd.state) == len(optimizer.sgd.state) > 0
    assert all(param.ndim == 4 for group in optimizer.muon.param_groups for param in group["params"])


def test_a_run_trains_with_muon_and_resumes_exactly(tmp_path):
    """With every Muon setting off its default (the fixed norm, weight decay, momentum)."""
    muon = ("optim.muon_fixed_norm=true", "optim.muon_weight_decay=0.01", "optim.muon_momentum=0.6")
    settings = ("optim=muon", *muon, "deterministic=true", "epochs=2")
    assert isinstance(assert_resumes_exactly(settings, tmp_path).optimizer, MuonWithSgd)


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("optim.muon_lr=-1", "optim.muon_lr must be finite and not negative, got -1.0"),
        ("optim.muon_momentum=1", "optim.muon_momentum must be in [0, 1), got 1.0"),
        ("optim.muon_weight_decay=-0.1", "optim.muon_weight_decay must be 0 or more"),
        ("optim.muon_ns_steps=0", "optim.muon_ns_steps must be 1 or more, got 0"),
    ],
)
def test_bad_muon_settings_are_refused_in_one_line(override, fragment):
    with pytest.raises(ConfigError) as caught:
        Trainer(compose_config("optim=muon", override))
    assert fragment in str(caught.value) and "\n" not in str(caught.value)


def test_onecycle_keeps_muons_momentum_and_cycles_sgds():
    net = small_net()
    optimizer = build_optimizer(MUON, net, {}, lr=0.1)
    scheduler = build_scheduler(MUON, optimizer, total_steps=10)
    train_steps(net, optimizer, steps=4)
    for _ in range(4):
        scheduler.step()
    assert [group["momentum"] for group in optimizer.muon.param_groups] == [MUON.muon_momentum]
    assert 0.85 < optimizer.sgd.param_groups[0]["momentum"] < 0.95


def test_a_weight_moved_after_the_optimizer_was_built_is_refused():
    """Muon steps aliases of the weights' memory: a model converted afterwards would leave its
    convolutions untrained without a word."""
    net = small_net()
    optimizer = build_optimizer(MUON, net, {}, lr=0.1)
    net.to(memory_format=torch.channels_last)
    with pytest.raises(TrainerError, match="moved or converted after the optimizer was built"):
        train_steps(net, optimizer, steps=1)


def test_a_model_without_convolutions_is_refused_in_one_line():
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(12, 10))
    with pytest.raises(ConfigError, match="no trainable Conv2d weights for Muon: use optim=sgd"):
        build_optimizer(MUON, mlp, {}, lr=0.1)
