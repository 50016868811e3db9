"""R6 at every write: a disk that fills at the k-th file a run writes (metrics.json records and
checkpoints, all through trainer.atomic.write_atomic) and stays full. For each k the run ends
with one error naming a file it could not write (the k-th, or TensorBoard's events where the
k-th is a checkpoint written beside the training); no file is half-written or left as a
temporary; metrics.json ends in a final status, or, where even that cannot be written, the
error log says so and which record stands; a checkpoint that exists loads."""

from __future__ import annotations

import errno
import json
import logging
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cli_environment, compose_config

from trainer import Trainer, checkpoint
from trainer import logging as run_logging
from trainer.atomic import write_atomic
from trainer.checkpoint import CHECKPOINT, load_checkpoint
from trainer.config import TrainerError
from trainer.logging import METRICS

RUN = ("epochs=2", "data.train_size=64")
# A 2-epoch run's writes: each epoch's checkpoint and record, then the final record
# (test_the_run_writes_this_many_files keeps the count honest).
WRITES = 5
ROOMS = {"full": 64, "nearly full": 700}  # bytes a file may grow to: nothing / a short record


def run_with_disk_full_from(write: int | None, room: int, run_dir: Path) -> tuple[str, list[Path]]:
    """(the error the run raised, what it wrote in order); the disk is full from write `write` on."""
    written: list[Path] = []
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)

    def counted(path: Path, *args, **kwargs) -> None:
        written.append(path)
        if len(written) == write:
            resource.setrlimit(resource.RLIMIT_FSIZE, (room, limits[1]))
        write_atomic(path, *args, **kwargs)

    error = ""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checkpoint, "write_atomic", counted)
        patch.setattr(run_logging, "write_atomic", counted)
        try:
            Trainer(compose_config(*RUN), run_dir).fit()
        except TrainerError as raised:
            error = str(raised)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    return error, written


def test_the_run_writes_this_many_files(tmp_path):
    error, written = run_with_disk_full_from(None, 0, tmp_path / "run")
    assert not error and len(written) == WRITES, [path.name for path in written]


@pytest.mark.parametrize("room", ROOMS.values(), ids=ROOMS.keys())
@pytest.mark.parametrize("write", range(1, WRITES + 1))
def test_a_disk_that_fills_at_any_write_loses_nothing_written(tmp_path, caplog, write, room):
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.ERROR):
        error, written = run_with_disk_full_from(write, room, run_dir)
    refused = written[write - 1]
    # A checkpoint is written beside the next epoch's training: TensorBoard's writer may meet
    # the full disk first, and then its events are the file named.
    beside = refused.name == "last.pt" and "TensorBoard's events" in error
    assert error.startswith("could not write") and (f"{refused}" in error or beside), error
    assert "Traceback" not in caplog.text
    assert list(run_dir.rglob("*.tmp")) == []
    if (run_dir / CHECKPOINT).exists():
        load_checkpoint(run_dir / CHECKPOINT)  # complete: the last one written whole
    if not (run_dir / METRICS).exists():
        assert f"no {METRICS} was written" in caplog.text
        return
    record = json.loads((run_dir / METRICS).read_text())  # never half-written
    if record["status"] != "failed":  # even the status could not be written: the log says so
        assert "the final record (status failed) could not be written" in caplog.text
        assert f"still says {record['status']}" in caplog.text


FAILING_EVENT_WRITER = """
import errno, sys
from pathlib import Path
from tensorboard.summary.writer.record_writer import RecordWriter
from trainer.config import TrainerError
from trainer.logging import RunLog

write, written, room = RecordWriter.write, [], int(sys.argv[2])

def full_disk_after_room_events(self, data):
    if len(written) == room:
        raise OSError(errno.ENOSPC, "No space left on device")
    written.append(data)
    write(self, data)

RecordWriter.write = full_disk_after_room_events
try:
    run_log = RunLog(Path(sys.argv[1]))
    run_log.scalars(1, {"train/loss": 1.0})
    run_log.close()
except TrainerError as error:
    print(error, file=sys.stderr)
"""


@pytest.mark.parametrize("room", [0, 1], ids=["first-event", "later-event"])
def test_tensorboards_writer_thread_meeting_a_full_disk_prints_no_traceback(tmp_path, room):
    """The writer's own thread meets the full disk (at the event the writer writes as it opens,
    or at a later one) and raises there too, where Python would print that thread's traceback.
    The run's one line is all that is printed."""
    command = [sys.executable, "-c", FAILING_EVENT_WRITER, str(tmp_path), str(room)]
    finished = subprocess.run(command, capture_output=True, text=True, env=cli_environment())
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert finished.stderr.startswith(f"could not write TensorBoard's events under {tmp_path} (No space")
    assert "Traceback" not in finished.stderr and len(finished.stderr.strip().splitlines()) == 1


def test_a_write_tensorboard_could_not_make_ends_the_run_in_one_line_naming_the_fix(tmp_path, monkeypatch):
    """TensorBoard's writer thread meets the full disk; the run hears of it at its next event."""
    run_log = run_logging.RunLog(tmp_path)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(run_log.writer, "add_scalar", full_disk)
    with pytest.raises(TrainerError) as caught:
        run_log.scalars(1, {"train/loss": 1.0})
    message = str(caught.value)
    expected = f"could not write TensorBoard's events under {tmp_path} (No space left on device)"
    assert message.startswith(expected)
    assert "ulimit -f" in message and "\n" not in message
    run_log.close()
