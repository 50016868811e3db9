"""Cached bytecode for torch where its install has none and Python would write none.

An install without compiled bytecode (uv's default, `pip install --no-compile`) in a Python
that writes none (PYTHONDONTWRITEBYTECODE=1, as many container images set, or a read-only
site-packages) compiles torch's 2,000-odd modules from source at every start: 7.3 s of a
21-second run on an H200 host, 5.5 s on a 2-core CPU. CPython can keep that bytecode in a
folder of its own (PYTHONPYCACHEPREFIX, `sys.pycache_prefix`); this module points it there,
under the user's cache folder, only in that case, and only when the user has not chosen a
prefix; the run's log says so the first time. The setting travels in the environment to every
process the run starts (DDP ranks, compile workers, a parallel sweep's jobs). Nothing in the
standard library or torch does this for a program; so it is done here, in CPython's terms.

Owns: whether this process caches bytecode, and where. Must not touch: anything after the
start (it runs before torch is imported).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

PREFIX_VARIABLE = "PYTHONPYCACHEPREFIX"
_first_use: str | None = None  # the note for the run's log, when this process made the cache folder


def cache_folder() -> Path:
    """Where the bytecode goes: $XDG_CACHE_HOME/trainer/pycache, or ~/.cache/trainer/pycache."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "trainer" / "pycache"


def has_current_bytecode(source: str) -> bool:
    """Whether Python would load `source`'s module from bytecode rather than compile it: a
    cached file for this interpreter whose header matches the source's time and size (or
    one checked by hash instead)."""
    try:
        cached = importlib.util.cache_from_source(source)
        with open(cached, "rb") as file:
            header = file.read(16)
        stat = os.stat(source)
    except (OSError, NotImplementedError, ValueError):
        return False
    if len(header) < 16 or header[:4] != importlib.util.MAGIC_NUMBER:
        return False
    flags = int.from_bytes(header[4:8], "little")
    if flags & 0b1:  # hash-based: valid without the source's time
        return True
    mtime, size = int.from_bytes(header[8:12], "little"), int.from_bytes(header[12:16], "little")
    return mtime == int(stat.st_mtime) & 0xFFFFFFFF and size == stat.st_size & 0xFFFFFFFF


def python_writes_bytecode_for(source: str) -> bool:
    """Whether this interpreter will write the missing bytecode itself, so the next start has it."""
    if sys.dont_write_bytecode:
        return False
    folder = Path(importlib.util.cache_from_source(source)).parent
    existing = folder if folder.exists() else folder.parent
    return os.access(existing, os.W_OK)


def cache_bytecode(package: str = "torch") -> Path | None:
    """Before `package` is imported: if it would be compiled from source at every start, have
    Python cache its bytecode (and every later import's) in cache_folder(). Returns that folder
    when it was set, None when Python already caches or the user chose a prefix."""
    if sys.pycache_prefix is not None or os.environ.get(PREFIX_VARIABLE):
        return None  # the user's own choice
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    if has_current_bytecode(spec.origin) or python_writes_bytecode_for(spec.origin):
        return None
    folder = cache_folder()
    first = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # nowhere to write: the start stays as it was
    if not os.access(folder, os.W_OK):
        return None
    sys.pycache_prefix = str(folder)
    sys.dont_write_bytecode = False  # into the cache folder only, never beside the sources
    os.environ[PREFIX_VARIABLE] = str(folder)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # the processes it starts write there too
    if first:
        global _first_use
        _first_use = (
            f"{package} was installed without bytecode and this Python writes none beside it: "
            f"Python's bytecode now goes to {folder}, which saves seconds at every later start "
            f"({PREFIX_VARIABLE}=<folder> picks another place)"
        )
    return folder


def first_use_note() -> str | None:
    """For the run's log, once (a sweep's later jobs get None): that this process made the
    cache folder, and why."""
    global _first_use
    note, _first_use = _first_use, None
    return note
