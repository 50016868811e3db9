"""A function replayed as a CUDA graph (trainer/perf/graphed.py, optim=muon's orthogonalization
under step_graph or reduce-overhead): the same results as calling it, for any inputs of the
captured shapes, a graph per signature, and no graphs past the limit. Needs a CUDA GPU."""

from __future__ import annotations

import pytest
import torch

from trainer.perf import graphed
from trainer.perf.graphed import CudaGraphed

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="captures CUDA graphs: needs a CUDA GPU"
)


def scaled_products(matrices: list[torch.Tensor], vectors: list[torch.Tensor], scale: float):
    products = [scale * (matrix @ vector) for matrix, vector in zip(matrices, vectors)]
    return products, sum(vector.sum() for vector in vectors)


def inputs(seed: int, size: int = 8):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    matrices = [torch.randn(size, size, device="cuda", generator=generator) for _ in range(3)]
    vectors = [torch.randn(size, device="cuda", generator=generator) for _ in range(3)]
    return matrices, vectors


def assert_same(got, expected):
    (got_products, got_total), (products, total) = got, expected
    for a, b in zip(got_products, products, strict=True):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(got_total, total)


def test_a_replay_computes_what_a_call_does_for_any_inputs_of_the_captured_shapes():
    function = CudaGraphed(scaled_products)
    for seed in range(3):  # the first call captures, the others replay with new inputs copied in
        matrices, vectors = inputs(seed)
        assert_same(function(matrices, vectors, 0.5), scaled_products(matrices, vectors, 0.5))
    assert len(function.graphs) == 1


def test_another_shape_or_scalar_gets_a_graph_of_its_own_and_past_the_limit_none(monkeypatch):
    monkeypatch.setattr(graphed, "MAX_GRAPHS", 3)
    function = CudaGraphed(scaled_products)
    calls = [(0, 8, 0.5), (1, 16, 0.5), (2, 8, 2.0), (3, 8, 3.0), (4, 16, 0.5)]
    for seed, size, scale in calls:
        matrices, vectors = inputs(seed, size)
        assert_same(function(matrices, vectors, scale), scaled_products(matrices, vectors, scale))
    assert len(function.graphs) == 3 and function.given_up  # (8, 3.0) ran as a plain call
