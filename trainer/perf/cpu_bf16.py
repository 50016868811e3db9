"""Whether bf16 autocast pays on this CPU, timed once at start-up.

    slowdown = bf16_conv_slowdown()   # bf16 time / fp32 time of one convolution step here

CPU flags do not tell: a 2-core CPU with avx512_bf16 and no AMX ran the CNN 10-13x slower in
bf16 (63-73 against 838-985 img/s), while a 2-core AMD EPYC with the same flags ran it 1.5-1.7x
faster (2,241-2,493 against 1,304-1,608 img/s; torch 2.14.1). So the run times forward and
backward convolution steps of CIFAR-sized activations both ways, taking turns (0.1 s on 2 idle
cores, 0.5 s on busy ones), and warns only where bf16 is clearly slower. A CPU with AMX's tile
units (amx_bf16) is not timed: its bf16 kernels are its fast path. torch has no such query,
hence this.

Owns: the probe. Must not touch: the run's model, its threads or its random state beyond the
probe's own tensors.
"""

from __future__ import annotations

import functools
import time

import torch

# bf16 is called slower beyond this ratio: amp costing 1.3x or more of a training run's time
# is worth a line. The probe reads high rather than low against training: a 2-core Xeon with
# AVX-512 and no bf16 units trained 2.2x slower with amp while the probe read 3.3-4.0x (an
# earlier threshold of 3 missed one start there). Where bf16 is faster (a 2-core AMD EPYC,
# 1.5-1.7x faster training) the fastest of several timings taken in turns read 0.45-0.59x,
# whatever single timings on a busy host scattered to.
SLOWER_BEYOND = 1.3


def cpu_has_amx() -> bool | None:
    """Whether the CPU lists AMX's bf16 tile units (amx_bf16); None where /proc/cpuinfo is absent."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return any(line.startswith("flags") and "amx_bf16" in line.split() for line in cpuinfo)
    except OSError:
        return None


def _step_seconds(weight: torch.Tensor, images: torch.Tensor, bf16: bool) -> float:
    """One forward-backward convolution step, input gradient included (as in a model's inner layers)."""
    started = time.perf_counter()
    with torch.enable_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = torch.nn.functional.conv2d(images, weight, padding=1)
    out.float().sum().backward()
    return time.perf_counter() - started


@functools.cache
def bf16_conv_slowdown(repeats: int = 5) -> float:
    """bf16 autocast's time over fp32's for one 3x3 convolution step (8x64x32x32, 64 filters):
    the fastest of `repeats` each, the two taking turns so that a busy moment of the host falls
    on both, after one untimed of each (oneDNN's first call picks and builds its kernels). Its
    tensors come from a generator of its own: the run's random state is left as it was."""
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(64, 64, 3, 3, generator=generator) / 24).requires_grad_()
    images = torch.randn(8, 64, 32, 32, generator=generator).requires_grad_()
    best = {False: float("inf"), True: float("inf")}
    for attempt in range(repeats + 1):
        for bf16 in best:
            seconds = _step_seconds(weight, images, bf16)
            if attempt:
                best[bf16] = min(best[bf16], seconds)
    return best[True] / max(best[False], 1e-9)


def cpu_bf16_slowdown() -> float | None:
    """How many times slower bf16 autocast is here, where it is clearly slower; else None."""
    if cpu_has_amx():
        return None
    slowdown = bf16_conv_slowdown()
    return slowdown if slowdown > SLOWER_BEYOND else None
