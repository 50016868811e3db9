"""Data parallelism without DistributedDataParallel's wrapper (ddp_sync=after_backward).

The model the step calls is compiled exactly as on one GPU. After backward (on the last
micro-batch of an optimizer step only) one collective averages the whole gradient, laid end to
end in one flat buffer; at the end of every epoch another averages the BatchNorm statistics,
so that evaluation, checkpoints and exports see the same model on every rank. At the start
rank 0's weights are broadcast, as DistributedDataParallel does.

Why by hand, beside torch's wrapper: compiled around DistributedDataParallel, dynamo breaks the
graph at the wrapper's forward (which it is told not to trace), and the wrapper's buffer
broadcast and reducer run on the host around the compiled model every step: on 2 H100s at 256
images per GPU (ResNet-18, perf=fast, torch 2.11) 108 kernel launches and 9.2 ms of host time
a step against 46 and 7.2 ms here, 47.7% per GPU against 82-85% (README, "Scaling out"). The
wrapper's bucketing earns nothing where the whole gradient is one bucket anyway (ResNet-18:
44.7 MB, one all-reduce of about 0.2 ms after backward), which is where ddp_sync=auto picks
this path (trainer/perf/ddp.py).

Must not touch: which path runs (trainer/perf/ddp.py), the process group (trainer/distributed.py),
the order of the step (trainer/loop.py calls these at its boundaries).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn


def memory_order(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as one 1-D view, in the order they lie in memory: a copy into or
    out of the flat buffer is then one contiguous run also for channels_last weights and their
    gradients (a reshape would permute them, a kernel each)."""
    dense = tensor.is_contiguous() or (
        tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last)
    )
    if not dense:
        raise ValueError(f"a tensor of strides {tensor.stride()} has no single run in memory")
    return tensor.as_strided((tensor.numel(),), (1,))


class FlatCollective:
    """One collective over many tensors of one dtype: laid end to end into one buffer, reduced
    or broadcast as one, copied back (one launch each way, whatever the tensor count)."""

    def __init__(self):
        self.world_size = dist.get_world_size()
        # NCCL averages inside the all-reduce; gloo has no AVG, so it sums and divides after
        self.average_op = dist.ReduceOp.AVG if dist.get_backend() == "nccl" else None

    def average(self, tensors: list[torch.Tensor]) -> None:
        self.through_flat(tensors, self.average_flat)

    def broadcast(self, tensors: list[torch.Tensor], source: int = 0) -> None:
        self.through_flat(tensors, lambda flat: dist.broadcast(flat, src=source))

    def average_flat(self, flat: torch.Tensor) -> None:
        if self.average_op is not None:
            dist.all_reduce(flat, op=self.average_op)
        else:
            dist.all_reduce(flat)
            flat.div_(self.world_size)

    @staticmethod
    def through_flat(tensors: list[torch.Tensor], collective: Callable[[torch.Tensor], None]) -> None:
        """Per dtype: the tensors laid end to end, the collective on that buffer, copied back."""
        for group in by_dtype(tensors):
            views = [memory_order(tensor) for tensor in group]
            flat = torch.cat(views)
            collective(flat)
            torch._foreach_copy_(views, flat.split([view.numel() for view in views]))


def by_dtype(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.dtype, []).append(tensor)
    return list(groups.values())


class GradientAverage:
    """`average_gradients()` before each optimizer step: every trainable parameter's .grad
    becomes the mean over the ranks. A parameter this rank's step left without a gradient
    counts as a zero gradient, so that every rank's buffer holds the same parameters.

    The gradients are averaged in one buffer per dtype, kept for the run, and each .grad is
    left as its stretch of that buffer (in the parameter's own layout): a gradient the backward
    accumulated there already is not copied at all, a fresh one is copied in by one multi-tensor
    kernel, and nothing is copied back. On 2 H200s under step_graph (ResNet-18, 256 per GPU)
    the torch.cat this replaces took 0.145 ms of a 4.03 ms step, the all-reduce 0.173 ms."""

    def __init__(self, module: nn.Module):
        self.parameters = [param for param in module.parameters() if param.requires_grad]
        self.collective = FlatCollective()
        self.groups = [FlatGradients(group) for group in by_dtype(self.parameters)]

    def __call__(self) -> None:
        for group in self.groups:
            group.gather()
            self.collective.average_flat(group.flat)


class FlatGradients:
    """One dtype's parameters, their gradients' buffer, and each parameter's view of it."""

    def __init__(self, parameters: list[nn.Parameter]):
        self.parameters = parameters
        self.flat = torch.zeros(
            sum(param.numel() for param in parameters), dtype=parameters[0].dtype, device=parameters[0].device
        )
        offsets = itertools.accumulate((param.numel() for param in parameters), initial=0)
        self.views = [
            self.flat.as_strided(param.shape, dense_strides(param), offset)
            for param, offset in zip(parameters, offsets)
        ]

    def gather(self) -> None:
        """Every gradient into the buffer, and every .grad its view (a missing one zero)."""
        sources, targets = [], []
        for param, view in zip(self.parameters, self.views):
            grad = param.grad
            if grad is None:
                view.zero_()
            elif grad.data_ptr() != view.data_ptr() or grad.stride() != view.stride():
                sources.append(grad)
                targets.append(view)
            param.grad = view
        if sources:
            torch._foreach_copy_(targets, sources)


def dense_strides(tensor: torch.Tensor) -> tuple[int, ...]:
    """The tensor's strides where they lay it out densely (contiguous or channels_last), else
    the contiguous ones."""
    try:
        memory_order(tensor)
    except ValueError:
        return torch.empty(tensor.shape, device="meta").stride()
    return tensor.stride()


class BufferAverage:
    """`sync_buffers()` at each epoch's end: the floating-point buffers (BatchNorm's running
    mean and variance) of each module become their mean over the ranks. Integer buffers (the
    batch counters) advance alike on every rank and are left as they are."""

    def __init__(self, modules: list[nn.Module]):
        unique = {id(buffer): buffer for module in modules for buffer in module.buffers()}
        self.buffers = [buffer for buffer in unique.values() if buffer.is_floating_point()]
        self.collective = FlatCollective()

    def __call__(self) -> None:
        if self.buffers:
            self.collective.average(self.buffers)


def broadcast_module(module: nn.Module) -> None:
    """Rank 0's parameters and buffers on every rank, as DistributedDataParallel starts."""
    with torch.no_grad():
        FlatCollective().broadcast([*module.parameters(), *module.buffers()])
