"""Hydra's question of a command's mode answered from the command line's checks.

Before it runs anything, Hydra's main composes the whole config once only to read `hydra.mode`
(`Hydra.get_mode`), then composes it again for the run. With the command line's own check
(trainer/cli_checks.py) that made three compositions of one config before a run began, each
0.06-0.08 s on a 2-core CPU: the most of a tuner's forked trial's start (trainer/trial_fork.py),
whose imports are done. The checks' composition holds the same `hydra.mode` wherever Hydra asks
of the same overrides and the same config (the flags that change which config is read, such as
--config-dir, add an override to the checks' list and so never match); only then is the answer
taken from it. Hydra has no switch for it; the method is wrapped here, once per process.

Owns: the checked overrides and their mode, and the wrapper. Must not touch: the checks
themselves (cli_checks.py), the run's own composition (Hydra's).
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

CONFIG_NAME = "config"  # the config the checks compose (cli_checks.composed)
_checked: tuple[list[str], object] | None = None  # (the overrides, sorted; their hydra.mode)


def remember(overrides: list[str], cfg: DictConfig) -> None:
    """The overrides the checks composed (`cfg`, with Hydra's node) and the mode they hold."""
    global _checked
    _checked = (sorted(overrides), OmegaConf.select(cfg, "hydra.mode", default=None))


def checked_mode(config_name: str | None, overrides: list[str]) -> tuple[bool, object]:
    """(whether the checks composed these overrides of this config, the mode they hold)."""
    if _checked is None or config_name != CONFIG_NAME or sorted(overrides) != _checked[0]:
        return False, None
    return True, _checked[1]


def install() -> None:
    """Hydra's `get_mode` answered from `remember`'s composition where it matches."""
    from hydra._internal.hydra import Hydra

    original = Hydra.get_mode
    if getattr(original, "asks_the_checks", False):
        return

    def get_mode(self, config_name, overrides, *args, **kwargs):
        known, mode = checked_mode(config_name, overrides)
        return mode if known else original(self, config_name, overrides, *args, **kwargs)

    get_mode.asks_the_checks = True
    Hydra.get_mode = get_mode
