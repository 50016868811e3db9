"""Run folder names. A sweep job's: its number, then the values it was swept over, e.g.
`3_amp=true,channels_last=true`. A single run's: its overrides, then the date and time.

TensorBoard names each run by its folder, so this is also what its legend and HParams table
show. conf/config.yaml sets `hydra.sweep.subdir` to `${trainer_job_dir:...}`; register_schema
(trainer/config.py) registers the resolver. No Hydra setting does this: `override_dirname`
holds every override of the job, the ones all jobs share included.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

MAX_OVERRIDES_CHARS = 96  # the overrides part; longer ones are cut and end in a hash of the whole
UNSAFE = re.compile(r"[^A-Za-z0-9._=,+-]")  # a path's '/' among them: one folder per job
# A swept `amp=false,true` reaches the job as the Python values False and True.
PYTHON_BOOL = re.compile(r"=(True|False)$")


def swept_keys(sweep_dir: str) -> set[str] | None:
    """The keys the sweep varies, from the command line Hydra's sweeper saved in
    <sweep dir>/multirun.yaml before the first job; None when it cannot be read."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    try:
        task = OmegaConf.load(Path(sweep_dir) / "multirun.yaml").hydra.overrides.task
        parsed = OverridesParser.create().parse_overrides(list(task))
    except Exception:  # any launcher that saves no such file: name the job by all its overrides
        return None
    return {override.key_or_group for override in parsed if override.is_sweep_override()}


def run_dir_name(overrides: list[str]) -> str:
    """A single run's folder under outputs/: its command-line overrides (as a sweep job's are
    written, below), or `defaults` when there are none; the date and time follow in a folder
    of their own (conf/config.yaml), so that TensorBoard's run list starts with what differs."""
    return (
        overrides_text([item for item in map(str, overrides) if not item.startswith("hydra.")]) or "defaults"
    )


def overrides_text(kept: list[str]) -> str:
    """`key=value,...`, every character outside [A-Za-z0-9._=,+-] as '-', a text over
    MAX_OVERRIDES_CHARS cut and ended in 8 hex digits of the whole."""
    text = ",".join(PYTHON_BOOL.sub(lambda match: f"={match.group(1).lower()}", item) for item in kept)
    safe = UNSAFE.sub("-", text)
    if len(safe) > MAX_OVERRIDES_CHARS:
        digest = hashlib.blake2b(text.encode(), digest_size=4).hexdigest()
        safe = f"{safe[: MAX_OVERRIDES_CHARS - 9]}-{digest}"
    return safe


def job_dir_name(number: int | str, overrides: list[str], sweep_dir: str) -> str:
    """`<number>_<key=value,...>` for the swept keys of this job's overrides (all of them when
    the sweep's own are unknown), every character outside [A-Za-z0-9._=,+-] as '-'; the number
    alone when none is left. Numbers keep names unique within a sweep; a cut name ends in 8 hex
    digits of the full text, so that it still says which job it is."""
    keys = swept_keys(sweep_dir)
    kept = [item for item in map(str, overrides) if keys is None or item.lstrip("+~").split("=")[0] in keys]
    safe = overrides_text(kept)
    return f"{number}_{safe}" if safe else str(number)
