"""SIGTERM to the whole process group, as job schedulers and terminals send it, while DataLoader
workers run: the run stops at a step, saves its checkpoint, says `interrupted` and exits 130."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import torch
from conftest import HANG_GUARD_S, SMALL, cli_environment

STEPS_PER_EPOCH = 8  # conftest.SMALL: 256 images / batch 32
EPOCHS = 200  # far more than the test waits for
# Persistent workers start once: the stop cannot land while one is starting, before its
# init function has run (a window of milliseconds at each epoch's start otherwise).
WORKERS = ["num_workers=2", "persistent_workers=true"]


def test_sigterm_to_the_process_group_with_workers_stops_and_saves(tmp_path):
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "trainer", *SMALL, f"epochs={EPOCHS}", *WORKERS, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        env=cli_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a job scheduler starts it
    )
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while time.monotonic() < deadline and process.poll() is None:
            metrics_file = run_dir / "metrics.json"
            if metrics_file.exists() and json.loads(metrics_file.read_text())["epochs"] >= 1:
                break
            time.sleep(0.1)
        os.killpg(process.pid, signal.SIGTERM)  # kill -TERM -- -<pgid>
        stdout, stderr = process.communicate(timeout=HANG_GUARD_S)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)

    assert process.returncode == 130, stdout[-2000:] + stderr[-2000:]
    assert "Traceback" not in stdout + stderr
    assert "stopped by SIGTERM" in stderr
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "interrupted"
    assert STEPS_PER_EPOCH <= metrics["steps"] < EPOCHS * STEPS_PER_EPOCH
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=False)
    assert saved["step"] == metrics["steps"]
