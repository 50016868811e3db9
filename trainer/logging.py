"""Run records: TensorBoard scalars and hparams, metrics.json, progress bar (rank 0 only).
Where log lines go (the console, the ranks' and torch elastic's) is trainer/console.py.

Owns: how these are written (RunLog, SilentRunLog for the other ranks, metrics.json read and
written atomically) and how numbers read in a log line. Must not touch: when they are
written or what a run reports (trainer/run.py, trainer/loop.py)."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shlex
import threading
from pathlib import Path

from trainer import tags
from trainer.atomic import RUN_FOLDER_FIX, NotWritten, remove_leftovers, write_atomic
from trainer.progress_bar import NoProgress, StepProgress

METRICS = "metrics.json"
log = logging.getLogger(__name__)


def write_json_atomic(
    path: Path, data: dict, what: str = "the run record", fix: str = RUN_FOLDER_FIX
) -> None:
    """All or nothing (trainer.atomic): NotWritten in one line when the disk refuses."""
    write_atomic(path, (json.dumps(data, indent=2, default=str) + "\n").encode(), what, fix)


def write_final_metrics(run_dir: Path, summary: dict) -> None:
    """metrics.json with a run's final status: the whole record, or where a full disk refuses
    it the status and error alone (a few hundred bytes); where even that is refused, one line
    says the record was lost and which one stands."""
    path = run_dir / METRICS
    remove_leftovers(path)  # a rank's write, where the launcher stopped it amid one
    try:
        write_json_atomic(path, summary)
        return
    except NotWritten:
        pass
    essentials = ("status", "error", "failed_rank", "epochs", "steps", "overrides")
    try:
        write_json_atomic(path, {key: summary[key] for key in essentials if key in summary})
    except NotWritten as error:
        standing = read_metrics(run_dir).get("status")
        log.error(
            "the final record (status %s) could not be written: %s; %s",
            summary["status"],
            str(error).split(": ", 1)[-1],
            f"{path} still says {standing}" if standing else f"no {METRICS} was written",
        )


def record_rejected_config(run_dir: Path, error: Exception, overrides: list[str]) -> None:
    """A config refused before any run began still leaves a metrics.json saying why."""
    with contextlib.suppress(NotWritten):  # a full disk: the error itself is what to report
        write_json_atomic(
            run_dir / METRICS, {"status": "failed", "error": str(error), "overrides": overrides}
        )


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
    and that quoted for the shell: "resume='outputs/seed=1/2026-11-26_05-53-03.123456_1'"."""
    text = str(value)
    if PLAIN_VALUE.fullmatch(text):
        return f"{key}={text}"
    escaped = text.replace("\\", "\\\\").replace("'", "\\'")
    override = f"{key}='{escaped}'"
    return f'"{override}"' if not set('$`"\\!') & set(override) else shlex.quote(override)


def metrics_version(run_dir: Path) -> tuple[int, int, int] | None:
    """What tells one write of a run's metrics.json from another (each is a new file renamed into
    place): its inode, mtime in ns and size; None while there is none. Not a comparison with the
    clock, whose reading can run ahead of a file system's coarser timestamps."""
    try:
        stat = (Path(run_dir) / METRICS).stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


def read_metrics(run_dir: Path, unless: tuple[int, int, int] | None = None) -> dict:
    """A run folder's metrics.json ({} when it has none, or when it is still the write that
    metrics_version() called `unless`)."""
    path = Path(run_dir) / METRICS
    if not path.is_file() or (unless is not None and metrics_version(run_dir) == unless):
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


def quiet_event_writer_errors() -> None:
    """TensorBoard's writer thread, when a write fails (a full disk), keeps the error for the
    writer's next call and raises it in the thread too, where Python printed its traceback on
    stderr before the run's own line. The run reports that error in one line
    (`RunLog.events_written`), so the thread's traceback is left out; any other thread's
    exception goes to the hook as before. By hand: neither TensorBoard nor torch has a switch."""
    if getattr(threading.excepthook, "quiets_event_writers", False):
        return
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        thread_module = type(args.thread).__module__ if args.thread is not None else ""
        if isinstance(args.exc_value, OSError) and thread_module.startswith("tensorboard."):
            return  # raised again at the writer's next call, where the run reports it
        previous(args)

    hook.quiets_event_writers = True
    threading.excepthook = hook


class RunLog:
    """Everything the main process writes into the run folder."""

    def __init__(self, run_dir: Path, x_per_step: int = 1):
        from torch.utils.tensorboard import SummaryWriter

        quiet_event_writer_errors()
        self.run_dir, self.x_per_step = run_dir, x_per_step
        with self.events_written():  # its first event is written here
            self.writer = SummaryWriter(str(run_dir / "tb"))
        self.settings_writer = None  # <run>/schedule: opened with the first setting written

    @contextlib.contextmanager
    def events_written(self):
        """TensorBoard's writer raises a write its thread could not make (a full disk) as a
        bare OSError at the next event or at close: here NotWritten, one line with the fix."""
        try:
            yield
        except OSError as error:
            raise NotWritten(
                f"could not write TensorBoard's events under {self.run_dir} ({error.strerror or error}): "
                f"{RUN_FOLDER_FIX}"
            ) from None

    def scalars(self, step: int, values: dict) -> None:
        """At x = step x x_per_step (tb_step: images trained on, or optimizer steps); the
        settings (tags.SETTINGS) into the run's schedule/ folder, the figures into tb/."""
        with self.events_written():
            for tag, value in values.items():
                if value is not None:
                    self.writer_of(tag).add_scalar(tag, value, step * self.x_per_step)

    def writer_of(self, tag: str):
        if tag not in tags.SETTINGS:
            return self.writer
        if self.settings_writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.settings_writer = SummaryWriter(str(self.run_dir / "schedule"))
        return self.settings_writer

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
        with self.events_written():
            self.writer.file_writer.add_summary(session_start)
            self.writer.file_writer.add_summary(session_end)

    def close(self) -> None:
        with self.events_written():
            try:
                self.writer.close()
            finally:
                if self.settings_writer is not None:
                    self.settings_writer.close()


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
