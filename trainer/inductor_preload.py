"""Imported by the forkserver (trainer/forkserver.py): what every forked process that compiles
(a tuner's trial, a sweep's job, a DDP rank) would otherwise pay at its first torch.compile,
done once for all of them. Inductor's modules (torch.compile imports them on its first call:
0.8 s on an H100 host, 0.9 s on a 2-core CPU), dynamo's list of backends, and the keys its
caches are looked up by, which torch works out once per process by hashing its own and
triton's files (torch_key 0.13 s; triton_key 0.36 s, a sha256 over the 505 MB libtriton).
torch keeps them in the process, so a process forked after this finds them.

Nothing here may start CUDA, which a forked process could then not use. Importing inductor asks
`torch.cuda.is_available()` (torch 2.11: `torch._inductor.runtime.benchmarking`, at import), and
torch's default answer starts the CUDA driver (cudaGetDeviceCount), which marks every process
forked afterwards (outputs/readme/gpu_h100x2_2026-11-26h.md). So the import runs with
PYTORCH_NVML_BASED_CUDA_CHECK=1, torch's documented way to answer from NVML without starting
CUDA (torch.cuda.is_available's docstring), and the variable is put back as it was after it.
A forked process checks it anyway (trainer.trial_fork.cuda_started_before_fork).

Owns: that preload. Must not touch: whether a process compiles (its config decides).
"""

from __future__ import annotations

import contextlib
import importlib
import os

from trainer.perf.compile_keys import inductor_cache_keys

NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


@contextlib.contextmanager
def cuda_checked_by_nvml():
    """torch.cuda.is_available() answered from NVML inside, without starting CUDA."""
    before = os.environ.get(NVML_CHECK)
    os.environ[NVML_CHECK] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[NVML_CHECK]
        else:
            os.environ[NVML_CHECK] = before


def preload() -> None:
    """Inductor imported, dynamo's backends found and the cache keys worked out, CUDA left alone.
    Dynamo looks for backends once per process, at its first compile, among every installed
    package's entry points: 0.16 s of a ResNet-18 warm-up on an H200 host (py-spy, 2026-11-28);
    torch keeps the answer, so a process forked after this finds it."""
    with cuda_checked_by_nvml():
        importlib.import_module("torch._inductor.compile_fx")
        importlib.import_module("torch.compiler").list_backends()
    inductor_cache_keys()


preload()
