"""ddp_shard_muon: each DDP rank orthogonalizes its share of the convolution weights and one
all-reduce hands every rank every update; the weights come out as one process steps them."""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import compose_config
from torch import nn

from trainer.config import OptimConfig, OptimizerName, to_train_config
from trainer.distributed import Ranks
from trainer.muon import build_muon_with_sgd
from trainer.muon_arithmetic import orthogonalized
from trainer.muon_shard import owned_by, shares
from trainer.perf import muon_share
from trainer.perf.notes import forget_said

MUON = OptimConfig(name=OptimizerName.muon, lr=0.1, momentum=0.9, muon_lr=0.05, muon_momentum=0.9)
# ResNet-18's convolution weights, in its order
RESNET18 = [
    (64, 3, 3, 3),
    *[(64, 64, 3, 3)] * 4,
    (128, 64, 3, 3),
    *[(128, 128, 3, 3)] * 3,
    (128, 64, 1, 1),
    (256, 128, 3, 3),
    *[(256, 256, 3, 3)] * 3,
    (256, 128, 1, 1),
    (512, 256, 3, 3),
    *[(512, 512, 3, 3)] * 3,
    (512, 256, 1, 1),
]


def cost(shape: tuple[int, ...]) -> int:
    rows, columns = shape[0], torch.Size(shape[1:]).numel()
    return min(rows, columns) ** 2 * max(rows, columns)


def test_each_weight_goes_to_one_rank_and_the_work_is_shared_evenly():
    shapes = [torch.Size(shape) for shape in RESNET18]
    for ranks in (2, 4):
        owners = shares(shapes, ranks)
        assert owners == shares(shapes, ranks)  # every rank computes the same answer
        for rank in range(ranks):
            assert owned_by(rank, ranks, tuple(shapes)) == tuple(owner == rank for owner in owners)
        loads = [
            sum(cost(RESNET18[index]) for index, owner in enumerate(owners) if owner == rank)
            for rank in range(ranks)
        ]
        # no rank gets more than its share plus the largest single weight's cost
        assert max(loads) <= sum(loads) / ranks + max(cost(shape) for shape in RESNET18)
        assert min(loads) > 0


def test_the_ranks_shares_summed_are_the_whole_step():
    torch.manual_seed(0)
    shapes = [(8, 27), (8, 27), (4, 72), (16, 8), (8, 27)]
    grads = [torch.randn(shape) for shape in shapes]
    buffers = [torch.randn(shape) for shape in shapes]
    arguments = (0.9, True, (3.4445, -4.775, 2.0315), 5, 1e-7)
    whole_buffers, whole = orthogonalized(grads, buffers, *arguments)
    shapes = tuple(grad.shape for grad in grads)
    parts = [orthogonalized(grads, buffers, *arguments, owned_by(rank, 2, shapes)) for rank in (0, 1)]
    for index, update in enumerate(whole):
        torch.testing.assert_close(parts[0][1][index] + parts[1][1][index], update, rtol=0, atol=0)
        for part in parts:  # the buffers move on every rank
            torch.testing.assert_close(part[0][index], whole_buffers[index], rtol=0, atol=0)


def small_net() -> nn.Module:
    torch.manual_seed(0)
    convolutions = [nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)]
    return nn.Sequential(*convolutions, nn.Flatten(), nn.Linear(64, 10))


def stepped_weights(share: tuple[int, int] | None) -> list[torch.Tensor]:
    """Three steps of the same gradients on every rank (as after DDP's average)."""
    net = small_net()
    groups = [{"params": [p for p in net.parameters() if p.requires_grad]}]
    optimizer = build_muon_with_sgd(replace(MUON, muon_fixed_norm=True), net, groups, 0.1, {}, None, share)
    torch.manual_seed(1)
    for _ in range(3):
        optimizer.zero_grad()
        nn.functional.cross_entropy(net(torch.randn(4, 3, 10, 10)), torch.randint(0, 10, (4,))).backward()
        optimizer.step()
    return [p.detach().clone() for p in net.parameters()]


def rank_steps(rank: int, world_size: int, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        results[rank] = stepped_weights((rank, world_size))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_two_gloo_ranks_sharing_the_work_step_the_weights_as_one_process():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(rank_steps, args=(2, free_port(), results), nprocs=2)
        ranks = [results[0], results[1]]
    alone = stepped_weights(None)
    for rank in ranks:
        for shared, own in zip(rank, alone):
            torch.testing.assert_close(shared, own, rtol=1e-6, atol=1e-6)


def test_the_toggle_acts_only_for_muon_over_several_ranks(caplog):
    cfg = to_train_config(compose_config("optim=muon"))
    assert muon_share(cfg, Ranks(rank=1, world_size=2)) == (1, 2)  # on by default
    off = to_train_config(compose_config("optim=muon", "ddp_shard_muon=false"))
    assert muon_share(off, Ranks(0, 2)) is None
    forget_said()
    with caplog.at_level(logging.DEBUG):
        assert muon_share(cfg, Ranks()) is None
        assert muon_share(to_train_config(compose_config()), Ranks(0, 2)) is None
    said = {record.getMessage(): record.levelno for record in caplog.records}
    assert any("one process: nothing to share out" in line for line in said)
    assert any("optim=sgd: only Muon's work is shared out" in line for line in said)
    assert set(said.values()) == {logging.DEBUG}  # the default, where it cannot act, is no news
