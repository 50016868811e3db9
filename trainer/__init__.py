"""Config-driven PyTorch training where every GPU optimization is a toggle."""

from trainer.config import TrainConfig, TrainerError
from trainer.trainer import Trainer

__all__ = ["Trainer", "TrainConfig", "TrainerError"]
