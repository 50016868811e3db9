"""What a command line asks for, read from its words alone (no config composed, no torch):
its overrides, Hydra's own overrides and whether it sweeps; the launcher it chooses and whether
its jobs run on this machine; an argument written as another tool's option.

Must not touch: composing or validating the config (trainer/cli_checks.py).
"""

from __future__ import annotations

from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser

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


def split_command_line(args: list[str]) -> tuple[list[str], list[str], bool]:
    """(the overrides to check, the other hydra.* overrides, is it a sweep). Hydra's own flags
    pass, but for the config folders they add (`--config-dir`, `hydra.searchpath`): a user's
    preset is found there, so the check searches them too."""
    overrides, hydra_overrides, multirun = [], [], False
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
        elif arg.startswith(("hydra.", "hydra/")):
            hydra_overrides.append(arg)
        else:
            overrides.append(arg)
    if search_path:
        overrides.append(f"hydra.searchpath=[{','.join(search_path)}]")
    return overrides, hydra_overrides, multirun


def folder_entry(folder: str) -> str:
    """A config folder as an entry of hydra.searchpath (quoted: paths may hold spaces)."""
    return f"'file://{Path(folder).resolve()}'"


# Hydra's own flags (hydra._internal.utils.get_args_parser); any other `-x` or `--x` is a slip.
HYDRA_FLAGS = HYDRA_FLAGS_WITH_VALUE | {
    "--help",
    "-h",
    "--hydra-help",
    "--version",
    "--resolve",
    "--run",
    "-r",
    "--multirun",
    "-m",
    "--shell-completion",
    "-sc",
}


def override_slip(args: list[str]) -> str | None:
    """The first argument written as another tool's option or with spaces around '=', as the
    override it means (`--epochs 1`, `--epochs=1`, `epochs = 1` -> `epochs=1`); None if none is."""
    for index, arg in enumerate(args):
        following = args[index + 1] if index + 1 < len(args) else None
        if arg.startswith("-") and arg.split("=")[0] not in HYDRA_FLAGS and len(arg.lstrip("-")) > 0:
            key, has_value, value = arg.lstrip("-").partition("=")
            if has_value:
                return f"`{arg}` is not an override: write {key}={value}"
            if following is not None and not following.startswith("-"):
                return f"`{arg} {following}` is not an override: write {key}={following}"
            return f"`{arg}` is not an option of python -m trainer: overrides are key=value, see --help"
        if arg == "=" and index > 0 and following is not None:
            return (
                f"`{args[index - 1]} = {following}` is not an override: write {args[index - 1]}={following}"
            )
        joinable = following is not None and "=" not in following and not following.startswith("-")
        if arg.endswith("=") and arg.count("=") == 1 and joinable:
            return f"`{arg} {following}` is not an override: write {arg}{following}"
        if arg.startswith("=") and index > 0 and "=" not in args[index - 1]:
            return f"`{args[index - 1]} {arg}` is not an override: write {args[index - 1]}{arg}"
    return None


LOCAL_LAUNCHERS = ("basic", "parallel")  # hydra/launcher choices that run the jobs on this machine
# Flags after which Hydra prints and exits without running: the machine is not checked.
PRINT_ONLY_FLAGS = {
    "--help",
    "-h",
    "--hydra-help",
    "--version",
    "--cfg",
    "-c",
    "--info",
    "-i",
    "--shell-completion",
    "-sc",
}


# Flags that make Hydra read another config than the one the checks compose (`config` in conf/)
CONFIG_FLAGS = {"--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd"}


def names_a_config(args: list[str]) -> bool:
    """Whether the command line points Hydra at another config or config folder: what the
    checks composed may then differ from the config the run is given."""
    return any(arg.split("=")[0] in CONFIG_FLAGS for arg in args)


def runs_here(args: list[str], hydra_overrides: list[str]) -> bool:
    """Whether this command trains on this machine, so that what it needs of the machine is
    checked here: not when Hydra only prints (--help, --cfg), nor for the jobs a cluster
    launcher (slurm) runs on its nodes."""
    return chosen_launcher(hydra_overrides) in LOCAL_LAUNCHERS and not any(
        arg.split("=")[0] in PRINT_ONLY_FLAGS for arg in args
    )


def chosen_launcher(hydra_overrides: list[str]) -> str:
    """The hydra/launcher the command line chooses: "basic" where it names none."""
    return next(
        (arg.split("=", 1)[1] for arg in hydra_overrides if arg.startswith("hydra/launcher=")), "basic"
    )


def parallel_sweep_here(args: list[str]) -> bool:
    """Whether the command is a sweep under hydra/launcher=parallel that runs on this machine
    (its workers then come from the trainer's forkserver, trainer/parallel_jobs.py). Read from
    the command line alone, so that the server can start before the checks compose a config
    per job (0.7 s for 4 jobs on a 2-core CPU)."""
    _, hydra_overrides, multirun = split_command_line(args)
    return parallel_sweep(hydra_overrides, multirun) and runs_here(args, hydra_overrides)


def parallel_sweep(hydra_overrides: list[str], multirun: bool) -> bool:
    return multirun and chosen_launcher(hydra_overrides) == "parallel"
