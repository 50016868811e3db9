"""Where log lines go: the command line's console (progress to stdout, warnings and errors to
stderr, quiet after one line when a stream cannot be written), the logs of launched ranks and
of torch elastic, and a line every so often while a long step runs.

Owns: the handlers and filters (conf/hydra/job_logging/trainer.yaml names two of them).
Must not touch: what is logged, or the run's records (trainer/logging.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

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
        closed = isinstance(error, ValueError) and getattr(self.stream, "closed", False)
        if not (isinstance(error, OSError) or closed):  # a format error is logging's to report
            super().handleError(record)
            return
        self.silenced = True
        name = getattr(self.stream, "name", "the console")
        with contextlib.suppress(OSError, ValueError):
            # later writes (print, the interpreter's last flush) go nowhere instead of failing
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)
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
