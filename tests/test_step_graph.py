"""step_graph: where it captures and where one line says why not (CPU); on a CUDA machine, the
captured step trains the same weights as the step run op by op."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import compose_config

from trainer import Trainer, perf
from trainer.config import DdpSync, to_train_config
from trainer.perf.model import compile_mode

CUDA = torch.device("cuda")  # a device object only: the decisions below read its type


def config(*overrides: str):
    return to_train_config(compose_config("step_graph=true", *overrides))


def test_captures_a_plain_cuda_run_and_only_when_asked():
    assert perf.step_graph_acts(config(), CUDA, None, splits_batches=False)
    assert perf.step_graph_acts(config("ddp=true"), CUDA, DdpSync.after_backward, splits_batches=False)
    assert not perf.step_graph_acts(config("step_graph=false"), CUDA, None, splits_batches=False)


@pytest.mark.parametrize(
    ("overrides", "device", "sync", "splits", "reason"),
    [
        ((), torch.device("cpu"), None, False, "CUDA graphs need CUDA, device is cpu"),
        (("grad_accum_steps=2",), CUDA, None, False, "grad_accum_steps=2: the graph holds"),
        (("ddp=true", "ddp_sync=wrapper"), CUDA, DdpSync.wrapper, False, "set ddp_sync=after_backward"),
        (("data_parallel=true",), CUDA, None, True, "data_parallel=true runs its replicas"),
    ],
)
def test_says_why_it_cannot_capture(caplog, overrides, device, sync, splits, reason):
    caplog.set_level(logging.INFO)
    assert not perf.step_graph_acts(config(*overrides), device, sync, splits_batches=splits)
    line = next(line for line in caplog.messages if line.startswith("step_graph=true has no effect here"))
    assert reason in line


@pytest.mark.parametrize(
    ("mode", "compiled_as"),
    [
        ("reduce_overhead", "default"),
        ("max_autotune", "max-autotune-no-cudagraphs"),
        ("default", "default"),
        ("max_autotune_no_cudagraphs", "max-autotune-no-cudagraphs"),
    ],
)
def test_compile_records_no_cuda_graphs_of_its_own_inside_the_step_graph(mode, compiled_as):
    cfg = config("compile=true", f"compile_mode={mode}", "set_to_none=true")
    assert compile_mode(cfg, CUDA, captured=True) == compiled_as
    assert compile_mode(cfg, CUDA, captured=False) == cfg.compile_mode.value


def test_zero_grad_keeps_the_gradients_the_graph_writes_into():
    """Under step_graph the parameters' .grad are the graph's own memory: zero_grad leaves them."""
    layer = torch.nn.Linear(2, 2)
    layer(torch.ones(1, 2)).sum().backward()
    grad = layer.weight.grad
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    perf.zero_grad(config("set_to_none=true"), optimizer, captured=True)()
    assert layer.weight.grad is grad and grad.abs().sum() > 0
    perf.zero_grad(config("set_to_none=true"), optimizer, captured=False)()
    assert layer.weight.grad is None


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="captures CUDA graphs: needs a CUDA GPU"
)


def trained_weights(tmp_path, *overrides: str) -> tuple[dict, dict]:
    """The weights after a few steps (fastcnn: BatchNorm statistics too), and the run's metrics."""
    trainer = Trainer(
        compose_config(
            "model=fastcnn",
            "device=cuda",
            "deterministic=true",
            "data.train_size=512",
            "batch_size=64",
            "epochs=2",
            *overrides,
        ),
        tmp_path,
    )
    metrics = trainer.fit()
    return {
        name: value.detach().float().cpu() for name, value in trainer.raw_model.state_dict().items()
    }, metrics


@needs_cuda
@pytest.mark.parametrize(
    "extra",
    [
        (),
        ("data.low_res=24", "data.low_res_epochs=1"),  # two shapes: a graph each, gradients swapped
        ("amp=true", "amp_dtype=bf16", "channels_last=true", "fused_optimizer=true"),
        ("optim=muon", "optim.muon_fixed_norm=true", "optim.muon_ns_steps=3"),  # Muon's graph too
    ],
)
def test_captured_step_trains_the_same_weights(tmp_path, extra):
    op_by_op, plain = trained_weights(tmp_path / "eager", *extra)
    captured, graphed = trained_weights(tmp_path / "graph", "step_graph=true", *extra)
    assert graphed["steps"] == plain["steps"] == 16
    for name, tensor in op_by_op.items():
        torch.testing.assert_close(captured[name], tensor, rtol=1e-3, atol=1e-4, msg=name)
    initial = Trainer(compose_config("model=fastcnn", "device=cuda"), tmp_path / "initial").build().raw_model
    moved = [
        name
        for name, value in initial.state_dict().items()
        if not torch.equal(value.float().cpu(), op_by_op[name])
    ]
    assert moved, "the weights never changed: the comparison would prove nothing"
