"""The errors a user can fix, each printed as one line without a traceback.

Owns: TrainerError (the base every module raises for such a problem), ConfigError (a
setting to change; its message names the key and the fix in override syntax) and Diverged. Both are
importable from trainer.config as well.
Must not touch: torch (the command-line check imports this before torch is loaded).
"""

from __future__ import annotations

from hydra.errors import CompactHydraException


class TrainerError(CompactHydraException):
    """A problem the user can fix; printed as one line, without a traceback."""


class ConfigError(TrainerError):
    pass


class Diverged(TrainerError):
    """The training ran away (a loss that is no longer finite, or grew far past where it began):
    the run stops, marked `diverged` in metrics.json."""
