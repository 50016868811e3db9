"""Config-driven PyTorch training where every GPU optimization is a toggle.

Owns: the package's public names (Trainer, TrainConfig, TrainerError). Must not touch: torch
at import time (Trainer is imported on first use, so that a command-line check answers first)."""

from trainer.config import TrainConfig, TrainerError

__all__ = ["Trainer", "TrainConfig", "TrainerError"]


def __getattr__(name: str):
    # Trainer pulls in torch (seconds): imported on first use, so that checking a command
    # line, which imports this package, answers before torch is loaded.
    if name == "Trainer":
        from trainer.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'trainer' has no attribute '{name}'")
