"""Run folder names, and where a sweep's jobs are.

A single run: `outputs/<its overrides>/<date>_<time>`. A job of a sweep whose folder is shaped
as the default one (`outputs/multirun/<date>/<time>`): beside the single runs, as
`outputs/<the values it was swept over>/<the sweep's date>_<time>_<job number>`, e.g.
`outputs/amp=true,channels_last=true/2026-11-26_05-53-03.123456_3`; the sweep folder keeps
multirun.yaml and the sweep's own files. A job of a sweep folder of any other shape
(hydra.sweep.dir=...): inside it, as `<job number>_<the values it was swept over>`.

TensorBoard names each run by its path under --logdir, so `tensorboard --logdir outputs` lists
every run and job by what differs first, the date and time after (HParams' Trial ID too).
Links from the sweep folder to its jobs would show each job twice (TensorBoard follows links),
so a sweep's jobs are found by their names instead (sweep_jobs). conf/config.yaml sets
`hydra.sweep.subdir` to `${trainer_job_dir:...}`; register_schema (trainer/config.py) registers
the resolver. No Hydra setting does this: `override_dirname` holds every override of the job,
the ones all jobs share included, and a sweep's jobs are always inside its folder.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
from pathlib import Path

MULTIRUN = "multirun"  # conf/config.yaml's hydra.sweep.dir: outputs/multirun/<date>/<time>
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
    """Where Hydra puts job `number`. In the default layout (a sweep folder shaped
    `<root>/multirun/<date>/<time>`): `<root>/<swept>/<date>_<time>_<number>`, as an absolute
    path (Hydra joins it to the sweep folder, which then drops out; a `..` after a linked
    multirun/ would lead elsewhere than Hydra's own abspath says). Else, inside the sweep
    folder: `<number>_<swept>`. <swept>: `key=value,...` of the swept keys of this job's
    overrides (every override when the sweep's own are unknown, or when it sweeps nothing),
    every character outside [A-Za-z0-9._=,+-] as '-', a cut text ending in 8 hex digits of the
    whole; `defaults` (inside the sweep folder: the number alone) when none is left."""
    keys = swept_keys(sweep_dir)
    kept = [item for item in map(str, overrides) if keys is None or item.lstrip("+~").split("=")[0] in keys]
    safe = overrides_text(kept)
    sweep = Path(os.path.abspath(sweep_dir))
    if in_default_layout(sweep):
        name = safe or run_dir_name(overrides)
        return os.path.join(sweep.parent.parent.parent, name, f"{sweep.parent.name}_{sweep.name}_{number}")
    return f"{number}_{safe}" if safe else str(number)


def in_default_layout(sweep_dir: Path) -> bool:
    """A sweep folder shaped `<root>/multirun/<date>/<time>` (conf/config.yaml's
    hydra.sweep.dir, or one given so): its jobs go to <root>, beside the single runs."""
    sweep_dir = Path(os.path.abspath(sweep_dir))
    return sweep_dir.parent.parent.name == MULTIRUN


def sweep_jobs(sweep_dir: Path) -> list[Path]:
    """The job folders of a sweep (holding .hydra/), in job order: inside the sweep folder, and
    in the default layout the `<root>/*/<date>_<time>_<number>` folders."""
    sweep_dir = Path(os.path.abspath(sweep_dir))
    inside = [folder for folder in sweep_dir.iterdir() if (folder / ".hydra").is_dir()]
    beside = []
    if in_default_layout(sweep_dir):
        stamp = f"{sweep_dir.parent.name}_{sweep_dir.name}"
        job = re.compile(rf"{re.escape(stamp)}_(\d+)")
        beside = [
            folder
            for folder in sweep_dir.parent.parent.parent.glob(f"*/{glob.escape(stamp)}_*")
            if job.fullmatch(folder.name) and (folder / ".hydra").is_dir()
        ]
    return sorted(inside + beside, key=lambda folder: job_place(folder).name.split("_")[0].zfill(12))


def job_place(folder: Path) -> Path:
    """Where a job folder would be inside its sweep folder: `<sweep>/<number>_<swept>` for a job
    of the default layout (`<root>/<swept>/<date>_<time>_<number>`, whose sweep folder
    `<root>/multirun/<date>/<time>` exists); any other folder as it is. What names a job in the
    report and in the sweep's last line: the same under either layout."""
    folder = Path(os.path.abspath(folder))
    stamp, _, number = folder.name.rpartition("_")
    if not number.isdigit():
        return folder
    root = folder.parent.parent
    for split in (index for index, char in enumerate(stamp) if char == "_"):
        sweep = root / MULTIRUN / stamp[:split] / stamp[split + 1 :]
        if (sweep / "multirun.yaml").is_file():
            return sweep / f"{number}_{folder.parent.name}"
    return folder
