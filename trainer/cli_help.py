"""`python -m trainer --help`: Hydra's help, with the template in conf/hydra/help/trainer.yaml.

The group list is made when the help is shown, from the YAML files of every config folder
on the search path (the package's conf/ and any `--config-dir`), so a user's own presets
appear beside ours; the schema's `*_schema` entries live in Hydra's ConfigStore, not in
those folders, so they stay out.

Hydra makes every part its help templates may name ($FLAGS_HELP, $APP_CONFIG_GROUPS, ...)
before it looks at the template; listing the groups its own way builds a config repository per
group, twice: 0.5 s of the 0.9-1.1 s that --help took on a 2-core CPU. Our template names none
of them, so `get_help` gives it as it is and leaves the rest to Hydra (--hydra-help names them).

Must not touch: the description of each key (trainer/config.py's comments are that).
"""

from __future__ import annotations

import string
from pathlib import Path

from hydra._internal.hydra import Hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

HYDRA_GET_HELP = Hydra.get_help
PLACEHOLDERS = ("FLAGS_HELP", "HYDRA_CONFIG_GROUPS", "APP_CONFIG_GROUPS", "CONFIG")


def config_groups() -> str:
    """One line per group: its options, the one this command line picks marked with '*'."""
    runtime = HydraConfig.get().runtime
    folders = [Path(source.path) for source in runtime.config_sources if source.schema == "file"]
    options: dict[str, set[str]] = {}
    for folder in folders:
        for path in folder.glob("*/*.yaml"):
            if path.parent.name != "hydra":
                options.setdefault(path.parent.name, set()).add(path.stem)
    lines = []
    for group, names in sorted(options.items()):
        picked = runtime.choices.get(group)
        listed = ", ".join(f"{name}*" if name == picked else name for name in sorted(names))
        lines.append(f"  {group:<6} {listed}")
    return "\n".join(lines)


def get_help(hydra: Hydra, help_cfg, cfg, args_parser, resolve: bool) -> str:
    """Hydra's help text, its parts made only where the template names one of them. By hand:
    Hydra has no setting that spares a template the parts it does not use."""
    template = help_cfg.template
    if any(name in template for name in PLACEHOLDERS):
        return HYDRA_GET_HELP(hydra, help_cfg, cfg, args_parser, resolve)
    return string.Template(template).substitute()


def register_help() -> None:
    OmegaConf.register_new_resolver("trainer_config_groups", config_groups, replace=True)
    Hydra.get_help = get_help
