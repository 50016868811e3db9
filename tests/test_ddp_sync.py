"""ddp_sync: the gradient averaged after backward without a wrapper trains as DistributedDataParallel
does (two gloo ranks on a CPU), BatchNorm statistics agree across ranks, and auto picks the path."""

from __future__ import annotations

import pytest
import torch
from conftest import compose_config

from trainer import Trainer
from trainer.config import DdpSync, to_train_config
from trainer.models import build_model
from trainer.perf import GradientAverage, gradient_sync

# fastcnn: BatchNorm, whose buffers the two paths keep alike in different ways (the wrapper
# broadcasts rank 0's every step, after_backward averages them at the epoch's end)
DDP = [
    "ddp=true",
    "devices=2",
    "deterministic=true",
    "data.train_size=256",
    "data.test_size=32",
    "batch_size=16",
]
STEPS = 6


def train_and_collect(ranks, configs: dict, run_dir: str) -> dict:
    """In a launched rank: each config trained for a few steps; its parameters and floating
    buffers, how often the gradients were averaged by hand, and whether a wrapper was built."""
    from trainer import distributed

    distributed.init_process_group("gloo", ranks, torch.device("cpu"))
    try:
        seen = {}
        for name, config in configs.items():
            trainer = Trainer(config, f"{run_dir}/{name}", ranks=ranks).build(ranks)
            averages = []
            average_gradients = trainer.average_gradients
            if isinstance(average_gradients, GradientAverage):  # else the no-op of a wrapped model

                def counted(calls=averages, average=average_gradients):
                    calls.append(1)
                    average()

                trainer.average_gradients = counted
            trainer.fit()
            seen[name] = {
                "parameters": {k: v.detach().clone() for k, v in trainer.raw_model.named_parameters()},
                "buffers": {
                    k: v.clone() for k, v in trainer.raw_model.named_buffers() if v.is_floating_point()
                },
                "averages": len(averages),
                "steps": trainer.progress.step,
                "wrapped": trainer.ddp_model is not None,
            }
        return seen
    finally:
        distributed.destroy_process_group()


@pytest.fixture(scope="module")
def both_paths(tmp_path_factory) -> list[dict]:
    """Each rank's results for the two paths, and after_backward with 2 micro-batches a step."""
    from trainer.distributed import launch

    run_dir = tmp_path_factory.mktemp("sync")
    variants = {
        "after_backward": ["ddp_sync=after_backward", f"max_steps={STEPS}"],
        "wrapper": ["ddp_sync=wrapper", f"max_steps={STEPS}"],
        "accumulated": [
            "ddp_sync=after_backward",
            "grad_accum_steps=2",
            "data.train_size=512",
            f"max_steps={STEPS}",
        ],
    }
    configs = {
        name: Trainer(compose_config("model=fastcnn", *DDP, *extra), run_dir).config
        for name, extra in variants.items()
    }
    ranks = [launch(2, train_and_collect, (configs, str(run_dir)))]
    return ranks


def test_after_backward_gives_the_weights_distributed_data_parallel_gives(both_paths):
    """Six SGD steps of fastcnn on two ranks: the same parameters to float tolerance (the
    all-reduce sums in another order), and only the wrapper path built a wrapper."""
    rank0 = both_paths[0]
    by_hand, wrapped = rank0["after_backward"], rank0["wrapper"]
    assert (by_hand["steps"], wrapped["steps"]) == (STEPS, STEPS)
    assert (by_hand["wrapped"], wrapped["wrapped"]) == (False, True)
    assert by_hand["averages"] == STEPS and wrapped["averages"] == 0
    for name, tensor in wrapped["parameters"].items():
        torch.testing.assert_close(by_hand["parameters"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    initial = build_model(to_train_config(compose_config("model=fastcnn")).model, num_classes=10)
    moved = [n for n, p in initial.named_parameters() if not torch.equal(p, wrapped["parameters"][n])]
    assert moved, "the weights never changed: the comparison would prove nothing"


def test_accumulation_averages_once_per_optimizer_step(both_paths):
    """2 micro-batches a step: still one average per optimizer step, none in between."""
    accumulated = both_paths[0]["accumulated"]
    assert accumulated["steps"] == STEPS
    assert accumulated["averages"] == STEPS


def test_rank_zero_keeps_batch_norm_statistics_it_averaged(both_paths):
    """The epoch ends with the statistics averaged: the checkpointed model has running means
    that moved from their initial zeros, and they are finite."""
    statistics = both_paths[0]["after_backward"]["buffers"]
    means = [tensor for name, tensor in statistics.items() if name.endswith("running_mean")]
    assert means and all(torch.isfinite(mean).all() for mean in means)
    assert any(mean.abs().sum() > 0 for mean in means)


def fastcnn(*overrides: str):
    return to_train_config(compose_config("model=fastcnn", "ddp=true", *overrides))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ((), DdpSync.after_backward),
        (("ddp_comm_hook=bf16",), DdpSync.wrapper),
        (("ddp_bucket_cap_mb=25",), DdpSync.wrapper),
        (("ddp_static_graph=true",), DdpSync.wrapper),
        (("ddp_gradient_as_bucket_view=true",), DdpSync.wrapper),
        (("ddp_sync=wrapper",), DdpSync.wrapper),
        (("ddp_sync=after_backward", "ddp_comm_hook=bf16"), DdpSync.after_backward),
    ],
)
def test_auto_picks_the_wrapper_only_where_a_setting_asks_for_it(overrides, expected):
    cfg = fastcnn(*overrides)
    assert gradient_sync(cfg, build_model(cfg.model, num_classes=10)) is expected


def test_auto_keeps_the_wrapper_for_a_gradient_larger_than_one_bucket():
    """Over 128 MB of gradient, the wrapper's buckets overlap backward: a 34M-parameter linear."""
    cfg = fastcnn()
    big = torch.nn.Linear(5800, 5800)  # 33.6M parameters, 128.3 MB in fp32
    assert gradient_sync(cfg, big) is DdpSync.wrapper


def test_the_averaged_gradients_stay_in_one_buffer_in_each_weights_layout(tmp_path):
    """One gloo rank: each .grad becomes a view of the buffer kept for the run, in its weight's
    layout (channels_last too), holding the gradient it was; a gradient the next backward
    accumulated in place there is averaged without a copy, and a missing one counts as zero."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4, 2))
        model = model.to(memory_format=torch.channels_last)
        average = GradientAverage(model)
        images = torch.randn(2, 3, 3, 3).to(memory_format=torch.channels_last)
        model(images).sum().backward()
        before = {name: param.grad.clone() for name, param in model.named_parameters()}
        average()
        (flat,) = [group.flat for group in average.groups]
        for name, param in model.named_parameters():
            assert param.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr(), name
            assert param.grad.stride() == param.stride(), name
            torch.testing.assert_close(param.grad, before[name], rtol=0, atol=0, msg=name)
        model(images).sum().backward()  # accumulates into the views in place
        model[2].bias.grad = None  # as a rank whose step gave this parameter no gradient
        average()
        torch.testing.assert_close(model[0].weight.grad, 2 * before["0.weight"])
        assert torch.equal(model[2].bias.grad, torch.zeros(2))
    finally:
        dist.destroy_process_group()
