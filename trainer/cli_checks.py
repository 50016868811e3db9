"""Command-line checks that run before Hydra makes a run folder.

A single run is composed and validated in full; in a sweep, each value of each swept key
is composed with the fixed overrides. Either way a mistake costs one line naming the fix and no folder.
"""

from __future__ import annotations

import re
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf.errors import OmegaConfBaseException

from trainer.checkpoint import resolve_checkpoint
from trainer.config import ConfigError, to_train_config, unknown_key_message
from trainer.torchrun_env import started_by_torchrun

PACKAGE_DIR = Path(__file__).resolve().parent
# The configs: a wheel ships the top-level conf/ inside the package (setup.py maps it to
# trainer/conf); a checkout and an editable install read conf/ where it is.
CONF_DIR = PACKAGE_DIR / "conf" if (PACKAGE_DIR / "conf").is_dir() else PACKAGE_DIR.parent / "conf"
HYDRA_FLAGS_WITH_VALUE = {
    "--config-path",
    "-cp",
    "--config-name",
    "-cn",
    "--config-dir",
    "-cd",
    "--experimental-rerun",
    "--info",
    "-i",
    "--package",
    "-p",
    "--cfg",
    "-c",
}


def split_command_line(args: list[str]) -> tuple[list[str], bool]:
    """(the overrides to check, is it a sweep). Hydra's own flags and hydra.* keys pass, but for
    the config folders they add (`--config-dir`, `hydra.searchpath`): a user's preset is found
    there, so the check searches them too."""
    overrides, multirun = [], False
    flag_with_value = None
    search_path = []
    for arg in args:
        if flag_with_value:
            if flag_with_value in ("--config-dir", "-cd"):
                search_path.append(folder_entry(arg))
            flag_with_value = None
        elif arg in ("-m", "--multirun"):
            multirun = True
        elif arg.startswith("-"):
            name, has_value, value = arg.partition("=")
            if has_value and name in ("--config-dir", "-cd"):
                search_path.append(folder_entry(value))
            flag_with_value = arg if arg in HYDRA_FLAGS_WITH_VALUE else None
        elif arg.startswith("hydra.searchpath="):
            search_path[:0] = [f"'{entry}'" for entry in OverridesParser.create().parse_override(arg).value()]
        elif not arg.startswith("hydra.") and not arg.startswith("hydra/"):
            overrides.append(arg)
    if search_path:
        overrides.append(f"hydra.searchpath=[{','.join(search_path)}]")
    return overrides, multirun


def folder_entry(folder: str) -> str:
    """A config folder as an entry of hydra.searchpath (quoted: paths may hold spaces)."""
    return f"'file://{Path(folder).resolve()}'"


def check_command_line(args: list[str]) -> None:
    overrides, multirun = split_command_line(args)
    if multirun and started_by_torchrun():
        raise ConfigError(
            "sweeps (-m) under torchrun are not supported: run the sweep without "
            "torchrun; with ddp=true each job launches its own processes"
        )
    if not multirun:
        check_composition(overrides)
        return
    parsed = OverridesParser.create().parse_overrides(overrides)
    fixed = [override.input_line for override in parsed if not override.is_sweep_override()]
    check_composition(fixed)
    for override in parsed:
        if not override.is_sweep_override() or override.is_interval_sweep():
            continue  # an interval is an optimizer's search space: the schema checks each job
        key = override.get_key_element()
        for value in override.sweep_string_iterator():
            check_composition([*fixed, f"{key}={value}"])


def check_composition(overrides: list[str]) -> None:
    try:
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=overrides)
    except Exception as error:  # Hydra's and OmegaConf's own, multi-line; keep what matters
        raise ConfigError(explain(error)) from None
    train_config = to_train_config(cfg)
    if train_config.resume:
        resolve_checkpoint(train_config.resume)
    if train_config.model.target:
        from trainer.models import check_target  # torch: the config is otherwise valid by now

        check_target(train_config.model.target)


def group_options(hydra_message: str) -> list[str]:
    """The options Hydra lists after 'Available options in ...' (every config folder searched),
    less the schema entries."""
    listed = re.search(r"Available options in '[^']+':\n((?:\t.*\n?)+)", hydra_message)
    names = listed.group(1).split() if listed else []
    return [name for name in names if not name.endswith("_schema")]


def explain(error: Exception) -> str:
    text = str(error)
    missing = re.search(r"Could not find '(\w+)/([^']+)'", text)
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
