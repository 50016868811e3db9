"""scripts/handwritten_muon.py, the hand-written peer of optim=muon: at the settings the bench
gives both (fixed norm, momentum 0.6, Nesterov, 3 Newton-Schulz steps) its steps move the
convolution weights as the trainer's Muon does, so the bench's muon rows differ only in how
the step runs."""

from __future__ import annotations

import sys

import torch
from conftest import REPO
from torch import nn

from trainer.config import OptimConfig
from trainer.muon import build_muon_with_sgd

sys.path.insert(0, str(REPO / "scripts"))
from handwritten_muon import HandMuon, split_parameters  # noqa: E402 - a development script


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1, bias=False),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


def gradients(model: nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(16, 3, 8, 8, generator=generator)
    labels = torch.randint(0, 10, (16,), generator=generator)
    nn.functional.cross_entropy(model(images), labels).backward()


def test_the_peer_steps_the_convolution_weights_as_the_trainers_muon():
    trainer_model, peer_model = small_model(), small_model()
    cfg = OptimConfig(muon_lr=0.12, muon_momentum=0.6, muon_fixed_norm=True, muon_ns_steps=3)
    groups = [{"params": list(trainer_model.parameters())}]
    trainer_muon = build_muon_with_sgd(cfg, trainer_model, groups, 0.0, {})
    ours, _ = split_parameters(peer_model)
    theirs, _ = split_parameters(trainer_model)
    peer = HandMuon(ours, lr=0.12, momentum=0.6, ns_steps=3, compile_mode="none")
    start = [weight.detach().clone() for weight in theirs]

    assert len(ours) == 2 and len(split_parameters(peer_model)[1]) == 4  # the convolutions; the rest
    for seed in range(3):  # the same gradients to both: the optimizers alone are compared
        trainer_model.zero_grad(set_to_none=True)
        gradients(trainer_model, seed)
        for mine, its in zip(ours, theirs):
            mine.grad = its.grad.clone()
        trainer_muon.step()
        peer.step()
    for mine, its, before in zip(ours, theirs, start):
        moved = (its - before).abs().max()
        # the same arithmetic in bf16, its products grouped otherwise (stacked, fused): within 3%
        assert moved > 0.05 and (mine - its).abs().max() <= 0.03 * moved
        assert torch.allclose(mine.norm(), its.norm(), rtol=1e-3)  # both at the fixed norm before the step


def test_the_peer_drops_its_gradients_as_zero_grad_does():
    model = small_model()
    weights, _ = split_parameters(model)
    peer = HandMuon(weights, lr=0.12, momentum=0.6, ns_steps=3, compile_mode="none")
    gradients(model, 0)
    peer.step()
    peer.zero_grad()
    assert all(weight.grad is None for weight in weights)
