"""The keys torch's compile caches are looked up by, worked out before the first compile asks
for them. torch works each out once per process by hashing files: its own (torch_key,
0.1-0.2 s) and triton's (triton_key, 0.4 s, a sha256 over the 505 MB libtriton), both inside a
fresh process's first compile, that is in its warm-up (one H100, recipe=fastcnn_94, profiled:
README, "From Enter to result"). Hashing lets other threads run, so a thread does it beside the
data's set-up (torch 2.13 added its own way to, used where it is there). A process forked from
the forkserver has them already (trainer/inductor_preload.py).

Owns: when the keys are worked out. Must not touch: whether a run compiles (trainer/perf/model.py).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

from trainer.config import TrainConfig

# Private to torch, hence looked up, not imported: a torch without one of them only loses the head start.
INDUCTOR_CACHE_KEYS = ("torch_key", "triton_key")


def inductor_cache_keys() -> None:
    """Each key worked out (torch keeps it for the process)."""
    from torch._inductor import codecache

    for key in INDUCTOR_CACHE_KEYS:
        with contextlib.suppress(Exception):
            getattr(codecache, key)()


def nothing_to_wait_for() -> None:
    """Where no thread of ours works the keys out."""


def cache_keys_ahead(cfg: TrainConfig) -> Callable[[], None]:
    """compile=true: the keys worked out beside what follows (the data's set-up, the model's);
    returns what waits for them, for the warm-up to call before its first compile. torch 2.13
    and later do it themselves in a thread of theirs (`prefetch()` on each key), and a call to
    the key waits for it; before that, a thread of ours calls them, and the warm-up joins it:
    a key asked for while our thread still hashes would be worked out twice, and the thread,
    taking Python's lock back after each 1 MB it hashes, advances slowly while the main thread
    runs Python (triton_key still hashed in the warm-up, one H100). Inductor's cache module is
    imported in the calling thread (torch.compile imports it at its first call anyway): two
    threads importing torch's modules at once could each meet the other's half-imported ones."""
    if not cfg.compile:
        return nothing_to_wait_for
    from torch._inductor import codecache

    keys = [getattr(codecache, name, None) for name in INDUCTOR_CACHE_KEYS]
    if all(hasattr(key, "prefetch") for key in keys):
        for key in keys:
            key.prefetch()
        return nothing_to_wait_for
    thread = threading.Thread(target=inductor_cache_keys, name="inductor-cache-keys", daemon=True)
    thread.start()
    return thread.join
