"""optim=muon's arithmetic for one step of a group's weights, without side effects (so that it
compiles to one graph, or is captured as one CUDA graph): the momentum, then each weight's
update orthogonalized by Newton-Schulz iterations, weights of one shape as one stack. The
optimizer around it (its state, the weight decay, the update's lr) is trainer/muon.py.

Owns: the arithmetic. Must not touch: whether it is compiled (trainer/perf/model.py).
"""

from __future__ import annotations

import torch


def newton_schulz(
    matrices: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration in bf16, as torch.optim.Muon runs it, for each of a
    stack of same-shaped matrices (k, rows, columns) at once: each matrix (wide side last) scaled
    to a norm of at most 1, then `steps` rounds of X <- aX + (bA + cA^2)X with A = XX^T, as
    batched products. Returns about U V^T of each matrix's SVD, in bf16."""
    a, b, c = coefficients
    x = matrices.bfloat16()
    transposed = x.size(1) > x.size(2)
    if transposed:
        x = x.mT
    x = x / x.norm(dim=(1, 2), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if transposed else x


def same_shapes(tensors: list[torch.Tensor]) -> list[list[int]]:
    """The positions of the tensors, grouped by shape (first seen first)."""
    groups: dict[torch.Size, list[int]] = {}
    for index, tensor in enumerate(tensors):
        groups.setdefault(tensor.shape, []).append(index)
    return list(groups.values())


def orthogonalized(
    grads: list[torch.Tensor],
    buffers: list[torch.Tensor],
    momentum: float,
    nesterov: bool,
    coefficients: tuple[float, float, float],
    steps: int,
    eps: float,
    owned: tuple[bool, ...] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One Muon step's arithmetic for a group's weights, without side effects (so that it
    compiles to one graph): the new momentum buffers, and each weight's orthogonalized update
    in the gradient's dtype. Weights of one shape are orthogonalized together, as one stack
    (ResNet-18's 20 convolutions: 11 stacks). `owned` (ddp_shard_muon): only the weights this
    rank orthogonalizes; the others' updates are zeros (trainer/muon_shard.py)."""
    eager = not torch.compiler.is_compiling()
    new_buffers, directions = momentum_directions(grads, buffers, momentum, nesterov, eager)
    # each replaced below, but for zeros where another rank orthogonalizes (ddp_shard_muon)
    updates = [grad if owned is None or owned[i] else torch.zeros_like(grad) for i, grad in enumerate(grads)]
    for group in same_shapes(directions):
        group = [index for index in group if owned is None or owned[index]]
        if not group:
            continue
        stacked = newton_schulz(torch.stack([directions[index] for index in group]), coefficients, steps, eps)
        if eager:  # one cast a stack (see momentum_directions for why not where compiled)
            stacked = stacked.to(grads[group[0]].dtype)
        for index, update in zip(group, stacked.unbind()):
            updates[index] = update.to(grads[index].dtype)
    return new_buffers, updates


def momentum_directions(
    grads: list[torch.Tensor], buffers: list[torch.Tensor], momentum: float, nesterov: bool, eager: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The new momentum buffers, and the directions Muon orthogonalizes (Nesterov's or the
    buffers). `eager`: as multi-tensor ops, one kernel for all the weights where there would be
    one a weight (what a CUDA graph of the uncompiled arithmetic replays). Compiled: weight by
    weight, which inductor fuses itself. torch 2.11's inductor failed an assertion in its loop
    reordering on the multi-tensor form with one cast a stack (ResNet-18's Muon step, one H200,
    2026-11-28); the compiled form is the one it was measured on before."""
    if eager:
        new_buffers = torch._foreach_lerp(buffers, grads, 1 - momentum)
        return new_buffers, torch._foreach_lerp(grads, new_buffers, momentum) if nesterov else new_buffers
    new_buffers = [buffer.lerp(grad, 1 - momentum) for grad, buffer in zip(grads, buffers)]
    if not nesterov:
        return new_buffers, new_buffers
    return new_buffers, [grad.lerp(buffer, momentum) for grad, buffer in zip(grads, new_buffers)]
