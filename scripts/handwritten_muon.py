"""Muon written by hand for scripts/handwritten_loop.py (--optimizer muon): the peer of the
trainer's optim=muon, as a PyTorch user tuning for speed writes it.

Each convolution weight is Muon's (picked by optim=muon's own rule), every other parameter
SGD's. A step, for each weight in turn: rescaled to a Frobenius norm of sqrt(output channels)
(optim.muon_fixed_norm), its momentum buffer lerped towards the gradient, Nesterov's direction
seen as output channels x fan-in, three (--muon-ns-steps) quintic Newton-Schulz rounds in bf16
with torch.optim.Muon's coefficients, and the update added at lr x sqrt(max(1, rows/columns))
(torch.optim.Muon's default rule). The whole step is one function, compiled (reduce-overhead:
its kernels replayed as a CUDA graph, the buffers marked static as torch's guide to compiling
optimizers does); --compile-mode none runs it eagerly. The lr is constant: a schedule changes
the numbers, not the work.

Not the trainer's arithmetic: no weights of one shape stacked into one batched product, no
multi-tensor kernels. That is the difference the bench's "muon" rows measure.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from trainer.muon import convolution_weights

COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(the 2-D convolutions' weights: Muon's, every other parameter: SGD's), picked as
    optim=muon picks them."""
    convolutions = convolution_weights(model)
    muon = [param for param in model.parameters() if id(param) in convolutions]
    return muon, [param for param in model.parameters() if id(param) not in convolutions]


def newton_schulz(matrix: torch.Tensor, steps: int) -> torch.Tensor:
    a, b, c = COEFFICIENTS
    x = matrix.bfloat16()
    transposed = x.size(0) > x.size(1)
    if transposed:
        x = x.T
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


class HandMuon:
    def __init__(
        self, weights: list[nn.Parameter], lr: float, momentum: float, ns_steps: int, compile_mode: str
    ):
        self.weights, self.lr, self.momentum, self.ns_steps = weights, lr, momentum, ns_steps
        self.buffers = [torch.zeros_like(weight) for weight in weights]
        self.run = self.step_all
        if compile_mode != "none":
            for buffer in self.buffers:
                torch._dynamo.mark_static_address(buffer)
            self.run = torch.compile(self.step_all, mode=compile_mode, dynamic=False)

    def step(self) -> None:
        self.run([weight.grad for weight in self.weights])

    @torch.no_grad()
    def step_all(self, grads: list[torch.Tensor | None]) -> None:
        for weight, grad, buffer in zip(self.weights, grads, self.buffers):
            if grad is None:  # a convolution this step did not use: left as it is, as Muon leaves it
                continue
            weight.mul_(math.sqrt(weight.size(0)) / weight.norm().clamp(min=1e-30))
            buffer.lerp_(grad, 1 - self.momentum)
            direction = grad.lerp(buffer, self.momentum).reshape(weight.size(0), -1)
            update = newton_schulz(direction, self.ns_steps).to(weight.dtype).reshape(weight.shape)
            rows, columns = direction.shape
            weight.add_(update, alpha=-self.lr * math.sqrt(max(1.0, rows / columns)))

    def zero_grad(self) -> None:
        for weight in self.weights:
            weight.grad = None
