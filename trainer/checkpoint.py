"""Atomic checkpoints (temp file + rename) and resume.

torch and numpy are imported where they are used: `resolve_checkpoint` is part of the
command-line check, which answers before torch is loaded.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from trainer.config import ConfigError, TrainConfig, TrainerError

CHECKPOINT = Path("checkpoints") / "last.pt"


def atomic_save(obj: object, path: Path) -> None:
    """A reader sees the old file or the new one, never half of one."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    torch.save(obj, temporary)
    os.replace(temporary, path)


def rng_states() -> dict:
    import numpy as np
    import torch

    states = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(states["torch"])
    np.random.set_state(states["numpy"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def resolve_checkpoint(resume: str) -> Path:
    """A checkpoint file, or a run folder holding checkpoints/last.pt."""
    path = Path(os.path.expanduser(resume))
    if path.is_dir():
        path = path / CHECKPOINT
    if not path.is_file():
        raise TrainerError(
            f"resume={resume}: no checkpoint at {path}. Give a checkpoint file or a run folder "
            f"that holds {CHECKPOINT} (e.g. resume=outputs/<date>/<time>)"
        )
    return path


def load_checkpoint(resume: str) -> tuple[Path, dict]:
    """The resolved checkpoint file and what it holds."""
    import torch

    path = resolve_checkpoint(resume)
    try:
        return path, torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:
        raise TrainerError(f"resume={resume}: {path} is not a readable checkpoint ({error})") from None


def save(path: Path, stateful: dict, **extra) -> None:
    """The state_dict of each named object, the RNG states and `extra`, atomically."""
    atomic_save(
        {**{name: obj.state_dict() for name, obj in stateful.items()}, "rng": rng_states(), **extra}, path
    )


def restore(state: dict, stateful: dict) -> None:
    for name, obj in stateful.items():
        obj.load_state_dict(state[name])
    restore_rng_states(state["rng"])


def check_compatible(state: dict, cfg: TrainConfig, total_steps: int) -> None:
    """Resuming needs the same model and the same LR schedule length."""
    saved = state["config"]
    saved_target = saved["model"].get("target")
    model = saved_target or saved["model"]["name"]
    if model != (cfg.model.target or cfg.model.name.value):
        fix = f"model.target={model}" if saved_target else f"model={model}"
        raise ConfigError(f"resume={cfg.resume} holds a {model} checkpoint: set {fix}")
    if state["total_steps"] != total_steps:
        limit = f" max_steps={saved['max_steps']}" if saved["max_steps"] is not None else ""
        raise ConfigError(
            f"resume={cfg.resume} continues a {state['total_steps']}-step schedule, this config makes "
            f"{total_steps} steps: set epochs={saved['epochs']}{limit} "
            f"batch_size={saved['batch_size']} as saved, or start a new run without resume"
        )
