"""Whether bf16 autocast pays on this CPU, timed once at start-up.

    slowdown = bf16_conv_slowdown()   # bf16 time / fp32 time of one convolution step here

CPU flags do not tell: a 2-core CPU with avx512_bf16 and no AMX ran the CNN 10-13x slower in
bf16 (63-73 against 838-985 img/s), while a 2-core AMD EPYC with the same flags ran it 1.5-1.7x
faster (2,241-2,493 against 1,304-1,608 img/s). So the run times a forward and backward
convolution of CIFAR-sized activations both ways (about 0.1 s on 2 cores) and warns only where
bf16 is slower. A CPU with AMX's tile units (amx_bf16) is not timed: its bf16 kernels are its
fast path. torch has no such query, hence this.

Owns: the probe. Must not touch: the run's model, its threads or its random state beyond the
probe's own tensors.
"""

from __future__ import annotations

import functools
import time

import torch

# bf16 is called slower only beyond this ratio: timer noise on a busy host stays below it.
SLOWER_BEYOND = 1.3


def cpu_has_amx() -> bool | None:
    """Whether the CPU lists AMX's bf16 tile units (amx_bf16); None where /proc/cpuinfo is absent."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return any(line.startswith("flags") and "amx_bf16" in line.split() for line in cpuinfo)
    except OSError:
        return None


def _step_seconds(weight: torch.Tensor, images: torch.Tensor, bf16: bool, repeats: int) -> float:
    """The fastest of `repeats` forward-backward steps, after one untimed (oneDNN's first call
    picks and builds its kernels)."""
    best = float("inf")
    for attempt in range(repeats + 1):
        started = time.perf_counter()
        with torch.enable_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = torch.nn.functional.conv2d(images, weight, padding=1)
        out.float().sum().backward()
        if attempt:
            best = min(best, time.perf_counter() - started)
    return best


@functools.cache
def bf16_conv_slowdown(repeats: int = 3) -> float:
    """bf16 autocast's time over fp32's for one 3x3 convolution step (8x64x32x32, 64 filters).
    Its tensors come from a generator of its own: the run's random state is left as it was."""
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(64, 64, 3, 3, generator=generator) / 24).requires_grad_()
    images = torch.randn(8, 64, 32, 32, generator=generator)
    fp32 = _step_seconds(weight, images, bf16=False, repeats=repeats)
    bf16 = _step_seconds(weight, images, bf16=True, repeats=repeats)
    return bf16 / max(fp32, 1e-9)


def cpu_bf16_slowdown() -> float | None:
    """How many times slower bf16 autocast is here, where it is clearly slower; else None."""
    if cpu_has_amx():
        return None
    slowdown = bf16_conv_slowdown()
    return slowdown if slowdown > SLOWER_BEYOND else None
