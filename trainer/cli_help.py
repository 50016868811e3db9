"""`python -m trainer --help`: Hydra's help, with the template in conf/hydra/help/trainer.yaml.

The group list is made when the help is shown, from the YAML files of every config folder
on the search path (the package's conf/ and any `--config-dir`), so a user's own presets
appear beside ours; the schema's `*_schema` entries live in Hydra's ConfigStore, not in
those folders, so they stay out.

Must not touch: the description of each key (trainer/config.py's comments are that).
"""

from __future__ import annotations

from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf


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


def register_help() -> None:
    OmegaConf.register_new_resolver("trainer_config_groups", config_groups, replace=True)
