"""optim=muon: torch.optim.Muon for the convolution weights, SGD (optim.lr, momentum, nesterov,
weight_decay, as optim=sgd) for every other parameter, stepped as one optimizer.

Muon's arithmetic is written out (`orthogonalized`, trainer/muon_arithmetic.py), op for op as
torch.optim.Muon's step computes it, because torch's step runs it weight by weight in eager
mode: some 20 small kernels a weight, 1.8 ms a step for the fast CNN on an H200 (191k img/s
against SGD's 284k).
As one side-effect-free function over all the weights it is compiled or replayed as one CUDA
graph, as compile_optimizer and the run's graphs decide (trainer/perf/model.py).
torch.optim.Muon keeps the parameter groups, the momentum buffers (its state) and the
checkpoints.

Why by hand: torch.optim.Muon takes 2-D parameters only, and a convolution's weight is 4-D.
Muon orthogonalizes each weight's update as a matrix of output channels x fan-in. Here each
convolution weight gets a 2-D alias over the same memory, in the order its elements lie in
(contiguous or channels_last: a different column order permutes the orthogonalized update the
same way, so the update is the same), and Muon steps the aliases, which writes into the
weights. Everything else sees the weights themselves: the schedulers (which set lr and
momentum in every parameter group), the gradient scaler, zero_grad and the checkpoints; the
aliases are put in Muon's groups only while it steps and saves.

Owns: which parameters Muon steps and the combined optimizer. Must not touch: the lr and its
scaling (trainer/optim.py), when it steps (trainer/loop.py).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
from torch import nn

from trainer import muon_shard
from trainer.config import ConfigError, OptimConfig, TrainerError
from trainer.muon_arithmetic import orthogonalized
from trainer.perf.all_reduce import memory_order


def convolution_weights(model: nn.Module) -> set[int]:
    """The ids of the 2-D convolutions' weights: Muon's. The biases, BatchNorm, the linear head
    and any other parameter go to SGD."""
    return {id(module.weight) for module in model.modules() if isinstance(module, nn.Conv2d)}


def matrix_alias(weight: torch.Tensor) -> nn.Parameter:
    """A 2-D parameter over the weight's memory: output channels x fan-in, in memory order
    (a dense layout, contiguous or channels_last, keeps each output channel's row in one run)."""
    return nn.Parameter(memory_order(weight.detach()).view(weight.shape[0], -1))


def as_matrix(grad: torch.Tensor, weight: torch.Tensor, alias: nn.Parameter) -> torch.Tensor:
    """The gradient as its weight's alias sees the weight (a copy only where its layout differs)."""
    if grad.stride() != weight.stride():
        grad = torch.empty_like(weight).copy_(grad)
    return grad.as_strided(alias.shape, alias.stride())


def adjusted_lr(lr: float, rule: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's adjust_lr_fn: "original" (its default) scales by sqrt(max(1, rows /
    columns)), "match_rms_adamw" by 0.2 sqrt(max(rows, columns))."""
    rows, columns = shape[:2]
    if rule in (None, "original"):
        return lr * math.sqrt(max(1.0, rows / columns))
    if rule == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, columns))
    return lr


class MuonWithSgd(torch.optim.Optimizer):
    """One optimizer over two: `sgd` for its groups, `muon` for the convolution weights. Its
    param_groups are theirs (the same dicts), so a scheduler's lr and momentum reach both."""

    def __init__(
        self,
        sgd: torch.optim.SGD,
        muon_groups: list[dict],
        muon_settings: dict,
        fixed_norm: bool = False,
        compiler: Callable[[Callable], Callable] | None = None,
        share: tuple[int, int] | None = None,
    ):
        self.fixed_norm, self.share = fixed_norm, share  # share: (rank, ranks) with ddp_shard_muon
        self.orthogonalized = compiler(orthogonalized) if compiler else orthogonalized
        self.weights = [group.pop("params") for group in muon_groups]
        self.aliases = [[matrix_alias(weight) for weight in weights] for weights in self.weights]
        groups = [{**group, "params": aliases} for group, aliases in zip(muon_groups, self.aliases)]
        self.sgd, self.muon = sgd, torch.optim.Muon(groups, **muon_settings)
        super().__init__([*sgd.param_groups, *self.muon.param_groups], sgd.defaults)
        self.show_weights()
        self.param_groups = [*self.sgd.param_groups, *self.muon.param_groups]

    def show_weights(self) -> None:
        for group, weights in zip(self.muon.param_groups, self.weights):
            group["params"] = weights

    @contextlib.contextmanager
    def muon_on_aliases(self) -> Iterator[None]:
        """Muon's groups hold the aliases, each with its weight's gradient seen as a matrix."""
        for group, aliases, weights in zip(self.muon.param_groups, self.aliases, self.weights):
            group["params"] = aliases
            for alias, weight in zip(aliases, weights):
                if alias.data_ptr() != weight.data_ptr() or weight.stride()[0] != alias.stride()[0]:
                    raise TrainerError(
                        "optim=muon: a convolution weight was moved or converted after the optimizer "
                        "was built, and Muon would step its old memory: move the model (device, "
                        "memory format) before building the optimizer"
                    )
                alias.grad = None if weight.grad is None else as_matrix(weight.grad, weight, alias)
        try:
            yield
        finally:
            for aliases in self.aliases:
                for alias in aliases:
                    alias.grad = None  # not to keep a gradient zero_grad dropped
            self.show_weights()

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.sgd.step(closure)
        if self.fixed_norm:
            self.rescale_weights()
        with self.muon_on_aliases():
            for group in self.muon.param_groups:
                self.step_group(group)
        return loss

    def step_group(self, group: dict) -> None:
        """torch.optim.Muon's step for one group (its state, its settings), the arithmetic in
        one call of `orthogonalized`, the weight decay and the update as multi-tensor ops."""
        aliases = [alias for alias in group["params"] if alias.grad is not None]
        if not aliases:
            return
        grads = [alias.grad for alias in aliases]
        buffers = [self.momentum_buffer(alias) for alias in aliases]
        shapes = tuple(alias.shape for alias in aliases)
        owned = muon_shard.owned_by(*self.share, shapes) if self.share else None
        new_buffers, updates = self.orthogonalized(
            grads,
            buffers,
            group["momentum"],
            group["nesterov"],
            tuple(group["ns_coefficients"]),
            group["ns_steps"],
            group["eps"],
            owned,
        )
        if owned is not None:
            updates = muon_shard.summed_over_ranks(updates)
        torch._foreach_copy_(buffers, new_buffers)
        lr, weight_decay = group["lr"], group["weight_decay"]
        if weight_decay:
            torch._foreach_mul_(aliases, 1 - lr * weight_decay)
        by_scale: dict[float, tuple[list, list]] = {}  # one multi-tensor add per lr scale
        for alias, update in zip(aliases, updates):
            scale = adjusted_lr(lr, group.get("adjust_lr_fn"), alias.shape)
            weights, steps = by_scale.setdefault(scale, ([], []))
            weights.append(alias)
            steps.append(update)
        for scale, (weights, steps) in by_scale.items():
            torch._foreach_add_(weights, steps, alpha=-scale)

    def momentum_buffer(self, alias: nn.Parameter) -> torch.Tensor:
        state = self.muon.state[alias]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(alias.grad)
        return state["momentum_buffer"]

    def rescale_weights(self) -> None:
        """optim.muon_fixed_norm: each weight Muon is about to step, scaled to a Frobenius norm of
        sqrt(output channels) (three multi-tensor kernels for all of them)."""
        weights = [weight for group in self.weights for weight in group if weight.grad is not None]
        if not weights:
            return
        scales = torch._foreach_norm(weights)
        torch._foreach_clamp_min_(scales, torch.finfo(weights[0].dtype).tiny)
        torch._foreach_reciprocal_(scales)
        torch._foreach_mul_(scales, [math.sqrt(len(weight)) for weight in weights])
        torch._foreach_mul_(weights, scales)

    def state_dict(self) -> dict:
        with self.muon_on_aliases():
            return {"sgd": self.sgd.state_dict(), "muon": self.muon.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.sgd.load_state_dict(state_dict["sgd"])
        with self.muon_on_aliases():
            self.muon.load_state_dict(state_dict["muon"])
        self.param_groups = [*self.sgd.param_groups, *self.muon.param_groups]


def build_muon_with_sgd(
    cfg: OptimConfig,
    model: nn.Module,
    groups: list[dict],
    lr: float,
    extra: dict,
    compiler: Callable[[Callable], Callable] | None = None,
    share: tuple[int, int] | None = None,
) -> MuonWithSgd:
    """`groups`: the parameter groups optim=sgd would get; their convolution weights move to Muon
    at optim.muon_lr (not scaled with the batch: Muon's update has a set size whatever the batch)."""
    convolutions = convolution_weights(model)
    sgd_groups, muon_groups = [], []
    for group in groups:
        kept = [param for param in group["params"] if id(param) not in convolutions]
        moved = [param for param in group["params"] if id(param) in convolutions]
        if kept:
            sgd_groups.append({**group, "params": kept})
        if moved:
            muon_groups.append({"params": moved})
    if not muon_groups:
        raise ConfigError("optim=muon: the model has no trainable Conv2d weights for Muon: use optim=sgd")
    sgd = torch.optim.SGD(
        sgd_groups,
        lr=lr,
        momentum=cfg.momentum,
        nesterov=cfg.nesterov,
        weight_decay=cfg.weight_decay,
        **extra,
    )
    settings = {
        "lr": cfg.muon_lr,
        "momentum": cfg.muon_momentum,
        "nesterov": True,
        "weight_decay": cfg.muon_weight_decay,
        "ns_steps": cfg.muon_ns_steps,
    }
    return MuonWithSgd(sgd, muon_groups, settings, cfg.muon_fixed_norm, compiler, share)
