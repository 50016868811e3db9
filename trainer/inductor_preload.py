"""Imported by the tuner's forkserver (trainer/trial_fork.py): what every trial that compiles
would otherwise pay at its first torch.compile, done once for all of them. Inductor's modules
(torch.compile imports them on its first call: 0.9 s on a 2-core CPU) and the keys its caches
are looked up by, which torch works out once per process by hashing its own and triton's files
(torch_key 0.13 s; triton_key 0.36 s, a sha256 over the 505 MB libtriton). torch keeps both
keys in the process, so a trial forked after this finds them. Nothing here starts CUDA (checked
by the trial, trainer.trial_fork.cuda_started_before_fork).

Owns: that preload. Must not touch: whether a trial compiles (its config decides).
"""

from __future__ import annotations

import contextlib

import torch._inductor.compile_fx  # noqa: F401
from torch._inductor import codecache

# Private to torch, hence looked up, not imported: a torch without one of them only loses the head start.
for key in ("torch_key", "triton_key"):
    with contextlib.suppress(Exception):
        getattr(codecache, key)()
