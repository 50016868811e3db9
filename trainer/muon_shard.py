"""ddp_shard_muon: optim=muon's orthogonalization shared out over the DDP ranks.

Every rank holds the same averaged gradients and the same momentum buffers, so without this
each one orthogonalizes every convolution weight, the same work N times. With it each rank runs
Newton-Schulz for its share of the weights only (`shares`: the largest first, each to the rank
with the least work so far), leaves zeros for the others, and one all-reduce sums the updates:
each element comes from exactly one rank, so every rank gets every update, as it would have
computed it.

Why by hand: torch.optim.Muon steps its parameters one by one and knows nothing of ranks; the
distributed Muon of its authors shards whole parameter lists over ranks with an all-gather
of equal slices, which our stacks of same-shaped weights (trainer/muon.py) do not fit.

Owns: which rank orthogonalizes which weight, the all-reduce of the updates. Must not touch:
the arithmetic (trainer/muon.py), when the optimizer steps (trainer/loop.py).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from trainer.perf.all_reduce import FlatCollective


def shares(shapes: list[torch.Size], world_size: int) -> list[int]:
    """The rank that orthogonalizes each weight (by position): the costliest first (a
    Newton-Schulz step of an m x n matrix costs about m^2 n, m the smaller side), each to the
    rank with the least cost so far, the lower rank on a tie. The same answer on every rank."""
    costs = [min(shape[0], shape[1:].numel()) ** 2 * max(shape[0], shape[1:].numel()) for shape in shapes]
    load, owner = [0] * world_size, [0] * len(shapes)
    for index in sorted(range(len(shapes)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[index] = rank
        load[rank] += costs[index]
    return owner


@functools.cache
def owned_by(rank: int, world_size: int, shapes: tuple[torch.Size, ...]) -> tuple[bool, ...]:
    """Which of these weights this rank orthogonalizes (worked out once per list of shapes: the
    optimizer asks at every step)."""
    return tuple(owner == rank for owner in shares(shapes, world_size))


def summed_over_ranks(updates: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every rank's updates, from each rank's share (zeros elsewhere), summed in place: one
    all-reduce of them laid end to end per dtype (trainer/perf/all_reduce.py)."""
    FlatCollective.through_flat(updates, dist.all_reduce)
    return updates
