"""How a toggle that cannot act says so: one log line per toggle and run, naming it in
override syntax.

Owns: say_once, cannot_act, at_default, cuda_only, override_value.
Must not touch: any toggle's effect (the other files of trainer/perf/).
"""

from __future__ import annotations

import logging
from enum import Enum

import torch

from trainer.config import TrainConfig

log = logging.getLogger(__name__)

_said: set[str] = set()  # what this run has said already (cleared by apply_backend_flags)


def forget_said() -> None:
    """A new run says its lines again (apply_backend_flags, the first call of a run)."""
    _said.clear()


def say_once(level: int, message: str, *args) -> None:
    """A log line that a run prints once, however many of its parts reach the same decision."""
    line = message % args
    if line not in _said:
        _said.add(line)
        log.log(level, line)


def cannot_act(toggle: str, reason: str, *, default: bool = False) -> None:
    """One line per toggle and run: at INFO for a toggle the run asked for, at DEBUG for a
    default (pinned memory on a machine without CUDA is nothing the user chose)."""
    level = logging.DEBUG if default else logging.INFO
    say_once(level, "%s has no effect here (%s); carrying on without it", toggle, reason)


def at_default(cfg: TrainConfig, name: str) -> bool:
    return getattr(cfg, name) == TrainConfig.__dataclass_fields__[name].default


def cuda_only(cfg: TrainConfig, name: str, device: torch.device, reason: str) -> bool:
    """A boolean toggle that acts on CUDA only: its value there, False elsewhere (said once, at
    DEBUG when the toggle is at its default)."""
    asked = getattr(cfg, name)
    if asked and device.type != "cuda":
        cannot_act(f"{name}=true", reason, default=at_default(cfg, name))
        return False
    return asked


def override_value(value: object) -> str:
    """A config value as it is written on the command line."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, bool):
        return str(value).lower()
    return format(value, "g") if isinstance(value, float) else str(value)
