"""A side-effect-free function of CUDA tensors replayed as one CUDA graph per input signature:
optim=muon's orthogonalization, whose some 20 small kernels a weight (and 60 matmuls a step
for ResNet-18's 20 convolutions at 3 Newton-Schulz steps) run at the host's launch pace
otherwise (ResNet-18 on an H200: 70-75k img/s with Muon against SGD's 102k, step_graph on).

Why by hand: torch.compile's CUDA graphs (reduce-overhead) share one memory pool with the
model's graphs, and a replay of the optimizer's graph overwrote the model's outputs the step
still read. A torch.cuda.CUDAGraph here has a pool of its own, reads only its own copies of
the inputs (copied in before each replay, so any tensor of the same shape may be passed) and
hands back outputs that stay valid until its next replay.

    graphed = CudaGraphed(function)
    outputs = graphed(tensors_a, tensors_b, 0.6, True)   # lists, tuples, tensors and scalars

Owns: the graphs and their inputs. Must not touch: what the function computes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from trainer.perf import autotune_ahead

log = logging.getLogger(__name__)

# Calls before a capture, on a side stream as torch's CUDA-graph notes ask: they compile a
# compiled function and build cuBLAS's workspaces, neither of which may happen while capturing.
EAGER_CALLS = 2
# Signatures (shapes, scalar arguments) past which the function runs without graphs: a scalar
# that changes every call (a momentum on a schedule) would otherwise capture a graph a call.
MAX_GRAPHS = 8


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]  # the graph reads these, copied in before each replay ...
    outputs: Any  # ... and writes these, anew each replay


class CudaGraphed:
    def __init__(self, function: Callable):
        self.function = function
        self.graphs: dict[tuple, Captured] = {}
        self.given_up = False

    def __call__(self, *args):
        leaves, spec = tree_flatten(args)
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        key = (spec, *(signature(leaf) for leaf in leaves))
        captured = self.graphs.get(key)
        if captured is None:
            if self.given_up or len(self.graphs) >= MAX_GRAPHS:
                self.give_up()
                return self.function(*args)
            captured = self.graphs[key] = self.capture(leaves, spec)
        torch._foreach_copy_(captured.inputs, tensors)
        captured.graph.replay()
        return captured.outputs

    def capture(self, leaves: list, spec) -> Captured:
        inputs = [leaf.clone() for leaf in leaves if isinstance(leaf, torch.Tensor)]
        given = iter(inputs)
        static_leaves = [next(given) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        static_args = tree_unflatten(static_leaves, spec)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(EAGER_CALLS):
                self.function(*static_args)
        torch.cuda.current_stream().wait_stream(side)
        from torch._dynamo import config as dynamo_config  # loaded by then: the optimizer's import

        autotune_ahead.wait()  # no other thread of ours allocates while a stream captures
        graph = torch.cuda.CUDAGraph()
        # thread_local: a DataLoader's pin-memory thread may use CUDA while this captures. A
        # compiled function called with the warm-up's very arguments does not recompile; should
        # its guards ever differ, the error says so instead of a compile inside the capture.
        with (
            dynamo_config.patch(error_on_recompile=True),
            torch.cuda.graph(graph, capture_error_mode="thread_local"),
        ):
            outputs = self.function(*static_args)
        return Captured(graph, inputs, outputs)

    def give_up(self) -> None:
        if not self.given_up:
            self.given_up = True
            log.info(
                "%s: more than %d input signatures, runs without CUDA graphs from here",
                getattr(self.function, "__name__", "a graphed function"),
                MAX_GRAPHS,
            )


def signature(leaf) -> tuple:
    """What a graph is specific to: a tensor's layout (not its memory: inputs are copied in), any
    other argument's value."""
    if isinstance(leaf, torch.Tensor):
        return (tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device)
    return (type(leaf), leaf)
