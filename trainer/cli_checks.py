"""Command-line checks that run before Hydra makes a run folder.

A single run is composed and validated in full; so is every job of a sweep of at most
JOBS_CHECKED_WHOLE jobs (of a larger one, each value of each swept key with the fixed
overrides). Then the folder Hydra will make is tried: it must be
possible to create it. Either way a mistake costs one line naming the fix and no folder.

Must not touch: torch (imported only once the command line has passed), the run itself.
"""

from __future__ import annotations

import itertools
import math
import re
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer import sweep_checks
from trainer.checkpoint import resolve_checkpoint
from trainer.command_line import override_slip, parallel_sweep, runs_here, split_command_line
from trainer.config import ConfigError, TrainConfig, to_train_config, unknown_key_message
from trainer.preflight import check_machine
from trainer.torchrun_env import started_by_torchrun

PACKAGE_DIR = Path(__file__).resolve().parent
# The configs: a wheel ships the top-level conf/ inside the package (setup.py maps it to
# trainer/conf); a checkout and an editable install read conf/ where it is.
CONF_DIR = PACKAGE_DIR / "conf" if (PACKAGE_DIR / "conf").is_dir() else PACKAGE_DIR.parent / "conf"
# A sweep of at most this many jobs is checked job by job (each 0.13 s on a 2-core CPU), which
# is the check Hydra's basic sweeper would make again before its first job (trainer/sweep_checks.py).
JOBS_CHECKED_WHOLE = 64


def check_command_line(args: list[str]) -> DictConfig:
    """The command line checked: one line per problem (ConfigError). Returns the config it
    composes to, with Hydra's node (a sweep's: with its fixed overrides only)."""
    slip = override_slip(args)
    if slip is not None:
        raise ConfigError(f"{slip} (overrides take no dashes and no spaces around '=')")
    overrides, hydra_overrides, multirun = split_command_line(args)
    sweep_checks.jobs_checked = False
    machine = runs_here(args, hydra_overrides)
    if multirun and started_by_torchrun():
        raise ConfigError(
            "sweeps (-m) under torchrun are not supported: run the sweep without "
            "torchrun; with ddp=true each job launches its own processes"
        )
    if multirun:
        fixed, jobs, every_job = check_sweep(overrides, machine)
        if parallel_sweep(hydra_overrides, multirun) and any(cfg.ddp for cfg in jobs):
            raise ConfigError(
                "ddp=true inside hydra/launcher=parallel: each job holds one GPU, and a DDP job "
                "would launch ranks onto GPUs the other jobs hold. Run a DDP sweep without "
                "hydra/launcher=parallel (its jobs then take turns, each on every GPU)"
            )
        hydra_cfg = composed([*fixed, *hydra_overrides], hydra_config=True)
        check_output_folder(hydra_cfg, multirun)
        # a config's own sweep (hydra.sweeper.params) adds jobs the command line does not spell out
        sweep_checks.jobs_checked = every_job and not OmegaConf.select(hydra_cfg, "hydra.sweeper.params")
        return hydra_cfg
    # one composition for both checks
    cfg = composed([*overrides, *hydra_overrides], hydra_config=True)
    check_output_folder(cfg, multirun)
    check_composition(overrides, machine, OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"]))
    return cfg


def check_sweep(overrides: list[str], machine: bool = True) -> tuple[list[str], list[TrainConfig], bool]:
    """Every job of the sweep composed and checked, where it has at most JOBS_CHECKED_WHOLE;
    else each swept value, composed with the fixed overrides. Returns the fixed overrides, the
    configs composed and whether they were every job."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    fixed = [override.input_line for override in parsed if not override.is_sweep_override()]
    swept = [override for override in parsed if override.is_sweep_override()]
    # an interval is an optimizer's search space: the schema checks each job as it comes
    values = [
        [f"{override.get_key_element()}={value}" for value in override.sweep_string_iterator()]
        for override in swept
        if not override.is_interval_sweep()
    ]
    if len(values) == len(swept) and math.prod(map(len, values)) <= JOBS_CHECKED_WHOLE:
        jobs = [check_composition([*fixed, *job], machine) for job in itertools.product(*values)]
        return fixed, jobs, True
    composed = [check_composition(fixed, machine)]
    composed += [check_composition([*fixed, value], machine) for key_values in values for value in key_values]
    return fixed, composed, False


def composed(overrides: list[str], hydra_config: bool = False) -> DictConfig:
    """The config these overrides compose to, with Hydra's own `hydra` node where asked;
    ConfigError in one line when they do not compose (a hydra.* key included)."""
    try:
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            return compose("config", overrides=overrides, return_hydra_config=hydra_config)
    except Exception as error:  # Hydra's and OmegaConf's own, multi-line; keep what matters
        raise ConfigError(explain(error)) from None


def check_composition(
    overrides: list[str], machine: bool = True, cfg: DictConfig | None = None
) -> TrainConfig:
    """The config these overrides compose to (`cfg`, where composed already), validated, and
    (`machine`) what it needs of this machine (trainer/preflight.py); ConfigError in one line
    when they do not."""
    train_config = to_train_config(composed(overrides) if cfg is None else cfg)
    if train_config.resume:
        resolve_checkpoint(train_config.resume)
    if machine:
        check_machine(train_config)
    if train_config.model.target:
        from trainer.model_target import check_target  # torch: the config is otherwise valid by now

        check_target(train_config.model.target)
    return train_config


def check_output_folder(cfg: DictConfig, multirun: bool) -> None:
    """Hydra makes the run folder (under -m, the sweep folder) and opens its log file there;
    where it cannot, it stops with a traceback. Try the same in the nearest folder that exists
    (`cfg`: composed with its `hydra` node)."""
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    try:
        folder = Path(OmegaConf.select(cfg, key))
    except (OmegaConfBaseException, ValueError):
        return  # it interpolates what only the running job knows (${hydra:...}): Hydra resolves it
    existing = folder
    while not existing.exists():
        existing = existing.parent
    problem = why_not_writable(existing.absolute())
    if problem:
        raise ConfigError(f"cannot make the run folder {folder}: {problem}: set {key}=/a/writable/folder")


def why_not_writable(folder: Path) -> str | None:
    if not folder.is_dir():
        return f"{folder} is a file"
    try:
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as error:
        return f"nothing can be written in {folder} ({error.strerror})"


def group_options(hydra_message: str) -> list[str]:
    """The options Hydra lists after 'Available options in ...' (every config folder searched),
    less the schema entries."""
    listed = re.search(r"Available options in '[^']+':\n((?:\t.*\n?)+)", hydra_message)
    names = listed.group(1).split() if listed else []
    return [name for name in names if not name.endswith("_schema")]


def explain(error: Exception) -> str:
    text = str(error)
    missing = re.search(r"Could not find '([\w/]+)/([^'/]+)'", text)  # hydra/launcher/nope too
    if missing:
        group, name = missing.groups()
        options = group_options(text)
        if options:
            choices = " or ".join(f"{group}={option}" for option in options)
            return f"unknown {group} '{name}': choose {choices}"
    unknown = re.search(r"Could not override '([^']+)'", text) or re.search(
        r"Key '([^']+)' is not in struct", text
    )
    if unknown:
        return unknown_key_message(unknown.group(1))
    present = re.search(r"An item is already at '([^']+)'", text)
    if present:
        return f"'{present.group(1)}' already exists: set it without '+' ({present.group(1)}=...)"
    cause = error.__cause__
    if isinstance(cause, OmegaConfBaseException):
        key = getattr(cause, "full_key", None)
        first = str(cause).splitlines()[0]
        return f"invalid value for {key}: {first}{type_hint(key, first)}" if key else first
    return text.strip().splitlines()[0]


def type_hint(key: str, message: str) -> str:
    """The fix, in override syntax, for a value of the wrong type."""
    if "bool" in message:
        return f": set {key}=true or {key}=false"
    if "Integer" in message:
        return f": set {key}=<a whole number>"
    if "Float" in message:
        return f": set {key}=<a number>"
    return ""
