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


def key_functions() -> list[Callable[[], object]]:
    """The functions that work the keys out and keep them. torch 2.13 and later have both in
    inductor's cache module; before, torch asks triton's own triton_key (kept by triton's
    lru_cache), and the cache module has none of that name: looking only there, a plain run on
    torch 2.11 still hashed triton's library inside its first compile (profiled, one H100)."""
    from torch._inductor import codecache

    found = {name: getattr(codecache, name, None) for name in INDUCTOR_CACHE_KEYS}
    if found["triton_key"] is None:
        with contextlib.suppress(ImportError):  # no triton: no key to work out
            from triton.runtime.cache import triton_key

            found["triton_key"] = triton_key
    return [key for key in found.values() if key is not None]


def inductor_cache_keys(keys: list[Callable[[], object]] | None = None) -> None:
    """Each key worked out (kept for the process by torch or triton)."""
    for key in key_functions() if keys is None else keys:
        with contextlib.suppress(Exception):
            key()


def nothing_to_wait_for() -> None:
    """Where no thread of ours works ahead (here, or CUDA's start in cuda_start.py)."""


def cache_keys_ahead(cfg: TrainConfig) -> Callable[[], None]:
    """compile=true: the keys worked out beside what follows (the data's set-up, the model's);
    returns what waits for them, for the warm-up to call before its first compile. torch 2.13
    and later do it themselves in a thread of theirs (`prefetch()` on each key), and a call to
    the key waits for it; before that, a thread of ours calls them, and the warm-up joins it:
    a key asked for while our thread still hashes would be worked out twice, and the thread,
    taking Python's lock back after each 1 MB it hashes, advances slowly while the main thread
    runs Python. Inductor's cache module and triton are imported in the calling thread
    (torch.compile imports them at its first call anyway): two threads importing torch's
    modules at once could each meet the other's half-imported ones."""
    if not cfg.compile:
        return nothing_to_wait_for
    keys = key_functions()  # imports inductor's cache module
    if all(hasattr(key, "prefetch") for key in keys):
        for key in keys:
            key.prefetch()
        return nothing_to_wait_for
    thread = threading.Thread(target=inductor_cache_keys, args=(keys,), name="inductor-cache-keys")
    thread.daemon = True  # joined by the warm-up; a run that ends before it does not wait
    thread.start()
    return thread.join
