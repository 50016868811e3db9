"""What torchrun tells each process it starts, through the environment; read without torch,
so that the command-line check runs before torch is imported. Must not touch: torch."""

from __future__ import annotations

import os


def started_by_torchrun() -> bool:
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))
