"""step_graph: the forward, the backward and the gradient average over the ranks of each
optimizer step, captured once as one CUDA graph and replayed.

Why by hand, beside torch.compile's CUDA graphs (compile_mode=reduce_overhead): those graph
the compiled forward and backward one at a time, and each replay passes through their Python
bookkeeping; around them the host still runs the 62 gradient accumulations, the copy into the
flat gradient and the all-reduce op by op. On 2 H100s at 256 images per GPU that host work
(7.2 ms a step, profiled) outlasts the GPUs' 4.3 ms of kernels (README, "Scaling out").
torch.cuda.graph records the whole backward pass, the NCCL all-reduce included, and a replay
is one launch. The optimizer stays outside, as torch.optim wrote it: OneCycleLR changes lr and
momentum every step, and SGD reads momentum as a Python number, which a captured kernel would
keep at its capture-time value.

    graph = StepGraph(parameters, buffers)
    loss, correct = graph(images, labels, body)   # body(images, labels) -> (loss, correct)

Owns: whether the toggle acts (step_graph_acts) and the graphs. Must not touch: the optimizer,
the loop's order (trainer/loop.py calls it for the micro-batch that ends an optimizer step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from trainer.config import DdpSync, TrainConfig, TrainerError
from trainer.perf import autotune_ahead
from trainer.perf.notes import cannot_act

# Eager passes before a capture, on a side stream as torch's CUDA-graph notes ask: they build
# what is built lazily (cuBLAS workspaces, cuDNN's autotuned plans, the communicator's buffers,
# compiled kernels), none of which may be created while a stream is capturing.
EAGER_PASSES = 3

Body = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def step_graph_acts(
    cfg: TrainConfig, device: torch.device, sync: DdpSync | None, splits_batches: bool
) -> bool:
    """Whether step_graph=true captures this run's step; where it cannot, one line says why.
    `sync`: how the ranks average gradients (None in one process); `splits_batches`: whether
    data_parallel=true splits each batch over GPUs of this process."""
    if not cfg.step_graph:
        return False
    reason = None
    if device.type != "cuda":
        reason = f"CUDA graphs need CUDA, device is {device}"
    elif cfg.grad_accum_steps > 1:
        reason = (
            f"grad_accum_steps={cfg.grad_accum_steps}: the graph holds the one micro-batch of an "
            "optimizer step; set grad_accum_steps=1 to capture"
        )
    elif sync is DdpSync.wrapper:
        reason = "DistributedDataParallel's reducer runs on the host: set ddp_sync=after_backward to capture"
    elif splits_batches:
        reason = "data_parallel=true runs its replicas in threads of their own, which a graph cannot hold"
    if reason is not None:
        cannot_act("step_graph=true", reason)
        return False
    return True


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    images: torch.Tensor  # the graph reads its inputs from these ...
    labels: torch.Tensor
    loss: torch.Tensor  # ... and writes its outputs here, anew each replay
    correct: torch.Tensor
    grads: list[torch.Tensor]  # and each parameter's gradient here


class StepGraph:
    """One CUDA graph per input shape (data.low_res trains at two), each in its memory pool.

    A graph's backward writes every gradient anew, into memory the graph owns: the parameters'
    .grad point there between replays, where the optimizer reads them, and must not be dropped
    or zeroed (zero_grad does nothing under step_graph). With two shapes in one process, each graph
    has its own gradients, and the parameters point at those of the graph that ran last; with
    several ranks both graphs leave them in the gradient average's buffer (trainer/perf/all_reduce.py)."""

    @classmethod
    def of(cls, model: nn.Module) -> StepGraph:
        return cls(
            [param for param in model.parameters() if param.requires_grad],
            [buffer for buffer in model.buffers()],
        )

    def __init__(self, parameters: list[nn.Parameter], buffers: list[torch.Tensor]):
        self.parameters = parameters
        self.buffers = buffers  # BatchNorm statistics: the eager passes' updates are undone
        self.graphs: dict[tuple, Captured] = {}
        self.current: Captured | None = None
        self.side: torch.cuda.Stream | None = None  # where every pass before a capture and the capture run

    def __call__(
        self, images: torch.Tensor, labels: torch.Tensor, body: Body
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, correct) of this batch, in the graph's memory: read or copy them before the
        next call."""
        key = (tuple(images.shape), images.stride(), images.dtype, tuple(labels.shape), labels.dtype)
        captured = self.graphs.get(key)
        if captured is None:
            captured = self.graphs[key] = self.capture(images, labels, body)
        if captured is not self.current:
            for param, grad in zip(self.parameters, captured.grads):
                param.grad = grad
            self.current = captured
        captured.images.copy_(images)
        captured.labels.copy_(labels)
        captured.graph.replay()
        return captured.loss, captured.correct

    def capture(self, images: torch.Tensor, labels: torch.Tensor, body: Body) -> Captured:
        static_images, static_labels = images.clone(), labels.clone()
        saved = [buffer.clone() for buffer in self.buffers]
        if self.side is None:
            self.side = torch.cuda.Stream()
        side = self.side
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(EAGER_PASSES):
                self.drop_grads()
                body(static_images, static_labels)
        torch.cuda.current_stream().wait_stream(side)
        # captured with no .grad, the backward assigns each gradient instead of adding to one
        self.drop_grads()
        autotune_ahead.wait()  # no other thread of ours allocates while a stream captures
        graph = torch.cuda.CUDAGraph()
        # on the eager passes' stream, as torch's make_graphed_callables does: each weight's
        # AccumulateGrad node, made by the first pass and kept, belongs to the stream it was
        # made on (so one stream for every shape's graph). Captured on torch's own capture
        # stream, each run printed torch's warning of the mismatch ("may incur unnecessary
        # synchronization", torch 2.11)
        with torch.cuda.graph(graph, stream=side):
            loss, correct = body(static_images, static_labels)
        with torch.no_grad():
            for buffer, value in zip(self.buffers, saved):
                buffer.copy_(value)
        missing = [index for index, param in enumerate(self.parameters) if param.grad is None]
        if missing:
            raise TrainerError(
                f"step_graph: {len(missing)} parameter(s) got no gradient in the captured step; "
                "a model whose graph changes between steps cannot be captured: set step_graph=false"
            )
        self.current = None  # the parameters point at this graph's gradients, set on replay
        return Captured(graph, static_images, static_labels, loss, correct, [p.grad for p in self.parameters])

    def release(self) -> None:
        """Destroys the graphs, at the end of training: before the process group, whose
        communicator a graph's captured all-reduce holds (destroying the group first hung
        both ranks of a 2-GPU run at exit)."""
        if self.graphs:
            torch.cuda.synchronize()
        self.graphs.clear()
        self.current = None

    def drop_grads(self) -> None:
        for param in self.parameters:
            param.grad = None
