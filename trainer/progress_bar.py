"""Progress a person can see, on a terminal or in a redirected log.

On a terminal: a tqdm bar per epoch, moved every micro-batch (tqdm redraws at most 10 times a
second), left on screen when the epoch ends with its rate and the last loss. Output that is not
a terminal (a log file, a pipe, a notebook's captured stream) gets a log line whenever the epoch
passes another tenth of its batches or 30 s have gone by since the last line.

Owns: when and how progress is shown. Must not touch: what the loop computes (it passes the
numbers to show), the run's records (trainer.logging).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

from tqdm import tqdm

log = logging.getLogger("trainer.progress")

LINE_EVERY_S = 30.0  # a redirected log hears from a slow epoch at least this often


class StepProgress:
    """tqdm's update / set_postfix / close, as a bar or as log lines."""

    def __init__(
        self,
        total: int,
        description: str,
        terminal: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.total, self.description, self.clock = total, description, clock
        self.terminal = sys.stderr.isatty() if terminal is None else terminal
        self.bar = (
            tqdm(total=total, desc=description, unit="batch", dynamic_ncols=True) if self.terminal else None
        )
        self.done, self.postfix = 0, {}
        self.started = self.last_line = clock()
        self.next_tenth = 1

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = self.clock()
        passed_tenth = self.total and self.done * 10 >= self.next_tenth * self.total
        if passed_tenth or now - self.last_line >= LINE_EVERY_S:
            self.next_tenth = self.done * 10 // max(self.total, 1) + 1
            self.last_line = now
            self.line(now)

    def line(self, now: float) -> None:
        shown = "".join(f" | {key} {value}" for key, value in self.postfix.items())
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        log.info(
            "%s | %d/%d batches%s | %.1f s%s",
            self.description,
            self.done,
            self.total,
            share,
            now - self.started,
            shown,
        )

    def set_postfix(self, refresh: bool = False, **values) -> None:
        self.postfix = values
        if self.bar is not None:
            self.bar.set_postfix(values, refresh=refresh)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class NoProgress:
    """What ranks other than 0 show: nothing (StepProgress's calls, doing nothing)."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, refresh: bool = False, **values) -> None:
        pass

    def close(self) -> None:
        pass
