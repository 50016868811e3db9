"""Run records: TensorBoard scalars and hparams, metrics.json, progress bar (rank 0 only);
where the log lines of launched ranks and of torch elastic go.

Owns: how these are written (RunLog, SilentRunLog for the other ranks, metrics.json read and
written atomically) and how numbers read in a log line. Must not touch: when they are
written or what a run reports (trainer/run.py, trainer/loop.py)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shlex
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from trainer.atomic import RUN_FOLDER_FIX, write_atomic
from trainer.progress_bar import NoProgress, StepProgress

METRICS = "metrics.json"
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # as Hydra's job log


class BelowLevel(logging.Filter):
    """Passes records below `level`: stdout gets progress, stderr gets warnings and errors
    (conf/hydra/job_logging/trainer.yaml)."""

    def __init__(self, level: str | int):
        super().__init__()
        self.level = logging.getLevelName(level) if isinstance(level, str) else level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < self.level


@contextlib.contextmanager
def still_running(what: str, every_s: float = 30.0) -> Iterator[None]:
    """While the block runs, a line every `every_s` seconds saying it still does (a compile
    warm-up can take minutes with nothing else to show)."""
    stop, started = threading.Event(), time.perf_counter()

    def beat() -> None:
        while not stop.wait(every_s):
            logging.getLogger("trainer.loop").info(
                "%s: still running, %.0f s so far", what, time.perf_counter() - started
            )

    thread = threading.Thread(target=beat, name="still-running", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def write_json_atomic(
    path: Path, data: dict, what: str = "the run record", fix: str = RUN_FOLDER_FIX
) -> None:
    """All or nothing (trainer.atomic): NotWritten in one line when the disk refuses."""
    write_atomic(path, (json.dumps(data, indent=2, default=str) + "\n").encode(), what, fix)


def path_in(run_dir: Path, path: Path | str) -> str:
    """A path as the run folder's records (metrics.json, evaluation.json) write it: relative to
    the folder where it lies inside it (the folder can move), else absolute (a checkpoint of
    another run, maybe on another drive)."""
    resolved, folder = Path(path).resolve(), Path(run_dir).resolve()
    return str(resolved.relative_to(folder)) if resolved.is_relative_to(folder) else str(resolved)


# A value Hydra's override parser reads as it stands and bash passes unchanged.
PLAIN_VALUE = re.compile(r"[\w/.+@%:-]+")


def shell_override(key: str, value: object) -> str:
    """key=value as a hint prints it, to work pasted into bash: as it stands where the value is
    plain; else quoted for Hydra (a sweep job's folder holds `=`, which its parser refuses bare)
    and that quoted for the shell: "resume='outputs/multirun/.../1_seed=1'"."""
    text = str(value)
    if PLAIN_VALUE.fullmatch(text):
        return f"{key}={text}"
    escaped = text.replace("\\", "\\\\").replace("'", "\\'")
    override = f"{key}='{escaped}'"
    return f'"{override}"' if not set('$`"\\!') & set(override) else shlex.quote(override)


def read_metrics(run_dir: Path, since: float | None = None) -> dict:
    """A run folder's metrics.json ({} when it has none, or none written after time `since`)."""
    path = Path(run_dir) / METRICS
    if not path.is_file() or (since is not None and path.stat().st_mtime < since):
        return {}
    return json.loads(path.read_text())


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


# What HParams shows of every run, whatever it changed: what it trained, on what, how long.
HPARAMS_CORE = {
    "model": "model.name",
    "data": "data.source",
    "epochs": "epochs",
    "batch_size": "batch_size",
    "seed": "seed",
}


def shown_hparams(config: dict, overrides: list[str]) -> dict:
    """The HParams of a run: the core above, then each key its command line set (a group such as
    perf=fast as its choice), at its value in the run's config. The full config stays in the
    run folder (.hydra/config.yaml); TensorBoard lists the union over the runs it reads, the
    keys whose values differ first. A run that left a key at its default shows it blank."""
    flat = flatten(config)
    shown = {name: flat[key] for name, key in HPARAMS_CORE.items() if key in flat}
    if flat.get("model.target") not in (None, "null"):
        shown["model"] = flat["model.target"]
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key.startswith("hydra") or key in shown:
            continue
        shown[key] = flat.get(key, value)
    return shown


def decimal(value: float | None) -> str:
    """A number of a log line to four places, '-' where there is none."""
    return "-" if value is None else f"{value:.4f}"


def percent(value: float | None) -> str:
    """A fraction of a log line as a percentage, '-' where there is none."""
    return "-" if value is None else f"{100 * value:.1f}%"


class RunLog:
    """Everything the main process writes into the run folder."""

    def __init__(self, run_dir: Path, x_per_step: int = 1):
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir, self.x_per_step = run_dir, x_per_step
        self.writer = SummaryWriter(str(run_dir / "tb"))

    def scalars(self, step: int, values: dict) -> None:
        """At x = step x x_per_step (tb_step: images trained on, or optimizer steps)."""
        for tag, value in values.items():
            if value is not None:
                self.writer.add_scalar(tag, value, step * self.x_per_step)

    def metrics(self, data: dict) -> None:
        write_json_atomic(self.run_dir / METRICS, data)

    def progress(self, total: int, description: str) -> StepProgress:
        return StepProgress(total, description)

    def hparams(self, config: dict) -> None:
        """`config` (flat: shown_hparams) as an HParams session, into this run's own event file.

        Only the session is written, no experiment summary and no scalars: TensorBoard then
        builds one experiment from every session it finds, so each start shows the same
        columns, the keys whose values differ between runs first (and ticked), and every scalar
        curve as a metric, valued at its last point. (torch's add_hparams declares an experiment
        per run, whose metric list TensorBoard takes from whichever run it reads first, and
        writes each metric again as a one-point chart at step 0.)"""
        from torch.utils.tensorboard.summary import hparams

        # Booleans and integers as text: TensorBoard would show them as 0/1 and 128.00.
        shown = {k: str(v).lower() if isinstance(v, (bool, int)) else v for k, v in config.items()}
        _, session_start, session_end = hparams(shown, {})
        self.writer.file_writer.add_summary(session_start)
        self.writer.file_writer.add_summary(session_end)

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

    def progress(self, total: int, description: str) -> NoProgress:
        return NoProgress()

    def hparams(self, config: dict) -> None:
        pass

    def close(self) -> None:
        pass


class ConsoleHandler(logging.StreamHandler):
    """A console stream that goes quiet once it cannot be written (stdout closed, piped into
    `head` that has left, a full device): one line on stderr says so, the run goes on, and its
    log file keeps every line. logging's own handler would print a `--- Logging error ---`
    block for every line after (778 lines of stderr for a 16-step run piped to `head -3`)."""

    silenced = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.silenced:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if not isinstance(error, (OSError, ValueError)):  # ValueError: a closed file
            super().handleError(record)
            return
        self.silenced = True
        name = getattr(self.stream, "name", "the console")
        with contextlib.suppress(OSError, ValueError):
            # later writes (print, the interpreter's last flush) go nowhere instead of failing
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
        if self.stream is not sys.stderr:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.write(
                    f"trainer: {name} cannot be written ({type(error).__name__}): the run goes on, "
                    "its log file keeps every line\n"
                )


def console_handlers() -> list[logging.Handler]:
    """The command line's console: progress to stdout, warnings and errors to stderr."""
    progress, problems = ConsoleHandler(sys.stdout), ConsoleHandler(sys.stderr)
    progress.addFilter(BelowLevel(logging.WARNING))
    problems.setLevel(logging.WARNING)
    for handler in (progress, problems):
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
    return [progress, problems]


def console_unless_configured() -> None:
    """A run started from Python (Trainer(cfg).fit()) logs what the command line shows, unless
    the caller has set up logging (any handler on the root or the trainer logger): theirs rules."""
    ours = logging.getLogger("trainer")
    if logging.getLogger().handlers or ours.handlers:
        return
    ours.setLevel(logging.INFO)
    for handler in console_handlers():
        ours.addHandler(handler)


def configure_rank_logging(ranks, run_dir: Path) -> None:
    """In a spawned or torchrun process: every rank logs to `rank<N>.log` in the run folder,
    rank 0 also to the console, as a single run does: progress to stdout, warnings and errors
    to stderr (conf/hydra/job_logging/trainer.yaml)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.INFO)
    run_dir.mkdir(parents=True, exist_ok=True)
    file = logging.FileHandler(run_dir / f"rank{ranks.rank}.log")
    file.setFormatter(logging.Formatter(LOG_FORMAT))
    for handler in [file, *(console_handlers() if ranks.is_main else [])]:
        root.addHandler(handler)
    # tqdm's default lock is a multiprocessing semaphore; a rank killed holding one leaves the
    # launcher a "leaked semaphore" warning at exit. A rank's bars are its own: a thread lock does.
    tqdm.set_lock(threading.RLock())


# torch.distributed.elastic's loggers (its agent, the launcher API, torch.multiprocessing)
ELASTIC_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")


class ToRankLogs(logging.Handler):
    """A record that names a local rank (elastic's traceback of a rank that ended) into that
    rank's log file in `log_dir`; any other into the launcher's own log files. Launches are on
    one host, where the local rank is the rank."""

    RANK = re.compile(r"local_rank[:=]\s*(\d+)")

    def __init__(self, log_dir: Path):
        super().__init__()
        self.log_dir = log_dir
        self.setFormatter(logging.Formatter(LOG_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        named = self.RANK.search(record.getMessage())
        if named is None:
            for handler in logging.getLogger().handlers:
                if isinstance(handler, logging.FileHandler):
                    handler.handle(record)
            return
        try:
            with open(self.log_dir / f"rank{named.group(1)}.log", "a") as file:
                file.write(self.format(record) + "\n")
        except OSError:
            self.handleError(record)


@contextlib.contextmanager
def elastic_logs_to(log_dir: Path) -> Iterator[None]:
    """While inside, torch elastic logs into the run folder (ToRankLogs), not to the terminal,
    where the launch's own one-line error is what a failed rank leaves."""
    handler = ToRankLogs(log_dir)
    loggers = [logging.getLogger(name) for name in ELASTIC_LOGGERS]
    propagate = [logger.propagate for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.propagate = False  # torch's own stderr handler sits on the "torch" logger above
    try:
        yield
    finally:
        for logger, before in zip(loggers, propagate):
            logger.removeHandler(handler)
            logger.propagate = before
