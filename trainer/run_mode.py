"""Hydra's question of a command's mode answered from the command line's checks.

Before it runs anything, Hydra's main composes the whole config once only to read `hydra.mode`
(`Hydra.get_mode`), then composes it again for the run. With the command line's own check
(trainer/cli_checks.py) that made three compositions of one config before a run began, each
0.06-0.08 s on a 2-core CPU: the most of a tuner's forked trial's start (trainer/trial_fork.py),
whose imports are done. The checks' composition holds the same `hydra.mode` where Hydra asks
of the very same overrides, in the same order (a later override of a key wins, so a list the
checks put in another order is left to Hydra), of the same config: trainer.__main__ remembers
nothing where a flag names another config or config folder (command_line.names_a_config).
Hydra has no switch for it; the method is wrapped here, once per process.

Owns: the checked overrides and their mode, and the wrapper. Must not touch: the checks
themselves (cli_checks.py), the run's own composition (Hydra's).
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

CONFIG_NAME = "config"  # the config the checks compose (cli_checks.composed)
_checked: tuple[list[str], object] | None = None  # (the overrides, in order; their hydra.mode)


def mode_of(cfg: DictConfig) -> object:
    """`hydra.mode` of a composition with Hydra's node (None where neither config nor command
    line sets it: Hydra then goes by -m)."""
    return OmegaConf.select(cfg, "hydra.mode", default=None)


def remember(overrides: list[str], cfg: DictConfig) -> None:
    """The overrides the checks composed, in their order, and the mode they hold (`cfg`)."""
    global _checked
    _checked = (list(overrides), mode_of(cfg))


def forget() -> None:
    """A command's checks begin: nothing remembered from an earlier command in this process."""
    global _checked
    _checked = None


def checked_mode(config_name: str | None, overrides: list[str]) -> tuple[bool, object]:
    """(whether the checks composed these overrides of this config, the mode they hold)."""
    if _checked is None or config_name != CONFIG_NAME or list(overrides) != _checked[0]:
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
