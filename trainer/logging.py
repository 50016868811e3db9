"""Run records: TensorBoard scalars and hparams, metrics.json, progress bar. Rank 0 only."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from tqdm import tqdm

from trainer.atomic import RUN_FOLDER_FIX, write_atomic

METRICS = "metrics.json"
FINAL_METRICS = (
    "test_acc",
    "test_acc_tta",
    "best_test_acc",
    "time_to_target_s",
    "img_per_s",
    "mfu",
    "train_time_s",
    "peak_mem_mb",
)


class BelowLevel(logging.Filter):
    """Passes records below `level`: stdout gets progress, stderr gets warnings and errors
    (conf/hydra/job_logging/trainer.yaml)."""

    def __init__(self, level: str | int):
        super().__init__()
        self.level = logging.getLevelName(level) if isinstance(level, str) else level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < self.level


def write_json_atomic(
    path: Path, data: dict, what: str = "the run record", fix: str = RUN_FOLDER_FIX
) -> None:
    """All or nothing (trainer.atomic): NotWritten in one line when the disk refuses."""
    write_atomic(path, (json.dumps(data, indent=2, default=str) + "\n").encode(), what, fix)


def read_metrics(run_dir: Path) -> dict:
    """A run folder's metrics.json ({} when it has none)."""
    path = Path(run_dir) / METRICS
    return json.loads(path.read_text()) if path.is_file() else {}


def flatten(config: dict, prefix: str = "") -> dict:
    """Nested config -> {'data.root': ...}; lists as strings, None as 'null' (for HParams)."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        elif isinstance(value, (bool, int, float, str)):
            flat[prefix + key] = value
        else:
            flat[prefix + key] = "null" if value is None else str(value)
    return flat


class RunLog:
    """Everything the main process writes into the run folder."""

    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir = run_dir
        self.writer = SummaryWriter(str(run_dir / "tb"))

    def scalars(self, step: int, values: dict) -> None:
        for tag, value in values.items():
            if value is not None:
                self.writer.add_scalar(tag, value, step)

    def metrics(self, data: dict) -> None:
        write_json_atomic(self.run_dir / METRICS, data)

    def progress(self, total: int, description: str) -> tqdm:
        # disable=None: a bar on a terminal, nothing in a redirected log.
        return tqdm(
            total=total, desc=description, unit="batch", dynamic_ncols=True, leave=False, disable=None
        )

    def hparams(self, config: dict, final: dict) -> None:
        """Into this run's own event file, so that a sweep folder shows every job in HParams."""
        metrics = {f"hparam/{key}": float(final[key]) for key in FINAL_METRICS if final.get(key) is not None}
        # add_hparams would store booleans as 0/1 numbers; as "true"/"false" they read as choices.
        hparams = {k: str(v).lower() if isinstance(v, bool) else v for k, v in flatten(config).items()}
        self.writer.add_hparams(hparams, metrics, run_name=".")

    def close(self) -> None:
        self.writer.close()


class SilentRunLog(RunLog):
    """Ranks other than 0 write nothing into the run folder."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir

    def scalars(self, step: int, values: dict) -> None:
        pass

    def metrics(self, data: dict) -> None:
        pass

    def progress(self, total: int, description: str) -> tqdm:
        return tqdm(total=total, disable=True)

    def hparams(self, config: dict, final: dict) -> None:
        pass

    def close(self) -> None:
        pass


def configure_rank_logging(ranks, run_dir: Path) -> None:
    """In a spawned or torchrun process: rank 0 logs to the console and the run's log file,
    every other rank to `rank<N>.log` in the run folder."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.INFO)
    run_dir.mkdir(parents=True, exist_ok=True)
    formatter = logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    handlers = [logging.FileHandler(run_dir / f"rank{ranks.rank}.log")]
    if ranks.is_main:
        handlers.append(logging.StreamHandler())
    for handler in handlers:
        handler.setFormatter(formatter)
        root.addHandler(handler)
