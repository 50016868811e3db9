"""Config-driven PyTorch training where every GPU optimization is a toggle.

Owns: the package's public names (Trainer, TrainConfig, TrainerError). Must not touch: torch,
Hydra or OmegaConf at import time: each name is imported on first use, so that a command-line
check answers before torch is loaded, and `python -m trainer`, which imports this package
first, hands its command to a server (trainer/serve) before it imports Hydra."""

__all__ = ["Trainer", "TrainConfig", "TrainerError"]


def __getattr__(name: str):
    # Trainer pulls in torch (seconds), the config Hydra and OmegaConf (0.2 s).
    if name == "Trainer":
        from trainer.trainer import Trainer

        return Trainer
    if name in ("TrainConfig", "TrainerError"):
        from trainer import config

        return getattr(config, name)
    raise AttributeError(f"module 'trainer' has no attribute '{name}'")
