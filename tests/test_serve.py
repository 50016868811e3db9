"""python -m trainer.serve: commands of its environment run forked from it, end as their runs
end, and stop their runs when stopped or killed; others run by themselves."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import HANG_GUARD_S, SMALL, cli_environment, ends_soon

from trainer import trials
from trainer.serve import client, protocol

LONG = [
    "model=cnn",
    "data=synthetic",
    "data.train_size=4096",
    "data.test_size=64",
    "batch_size=32",
    "epochs=50",
    "device=cpu",
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A server in a folder of its own; the environment its commands are handed over in."""
    folder = tmp_path_factory.mktemp("serve")
    env = cli_environment({"TRAINER_SERVE": "1", "TRAINER_SERVE_DIR": str(folder / "sockets")})
    server = subprocess.Popen(
        [sys.executable, "-m", "trainer.serve", "--idle-minutes", "30"],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    ready = server.stdout.readline()
    assert "ready" in ready, ready
    yield {"env": env, "folder": folder, "server": server}
    if server.poll() is None:
        server.kill()
    server.wait()


def trainer(served, *args: str, env: dict | None = None, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "trainer", *args],
        cwd=served["folder"],
        env={**served["env"], **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def test_a_command_of_the_servers_environment_runs_forked_from_it(served):
    for switch in ("1", "0"):
        run_dir = served["folder"] / f"run-{switch}"
        process = trainer(
            served, *SMALL, "device=cpu", f"hydra.run.dir={run_dir}", env={"TRAINER_SERVE": switch}
        )
        out, err = process.communicate(timeout=HANG_GUARD_S)
        assert process.returncode == 0, err
        assert metrics(run_dir)["served"] is (switch == "1")
        assert ("forked from python -m trainer.serve" in (run_dir / "__main__.log").read_text()) is (
            switch == "1"
        )


def test_a_served_command_ends_as_its_run_ended(served):
    process = trainer(served, *SMALL, "device=cpu", "epochs=oops")
    out, err = process.communicate(timeout=HANG_GUARD_S)
    assert process.returncode == 2
    assert err.strip().splitlines() == [err.strip()] and err.startswith(
        "trainer: error: invalid value for epochs"
    )


def test_a_served_parallel_sweep_runs_its_jobs_in_workers_of_the_served_process(served):
    """Its workers' server is forked from the served command, which holds its preload."""
    sweep_dir = served["folder"] / "parallel"
    args = ["-m", "hydra/launcher=parallel", "hydra.launcher.n_jobs=2", *SMALL, "device=cpu", "seed=0,1"]
    process = trainer(served, *args, f"hydra.sweep.dir={sweep_dir}")
    out, err = process.communicate(timeout=HANG_GUARD_S)
    assert process.returncode == 0, err
    jobs = [json.loads(path.read_text()) for path in sorted(sweep_dir.glob("*/metrics.json"))]
    assert [(job["status"], job["served"]) for job in jobs] == [("completed", True)] * 2


def test_the_trainer_command_and_another_name_of_the_interpreter_are_served_too(served):
    """The console script (`trainer`) and the interpreter by its other name (`python3` beside
    `python`) find the server: an interpreter counts by its file, not by the name it was called."""
    bin_dir = Path(sys.executable).parent
    other = bin_dir / ("python3" if Path(sys.executable).name != "python3" else "python")
    heads = [[str(bin_dir / "trainer")]] if (bin_dir / "trainer").is_file() else []
    heads += [[str(other), "-m", "trainer"]] if other.exists() else []
    if not heads:
        pytest.skip("no console script and no other name of the interpreter beside it")
    for number, head in enumerate(heads):
        run_dir = served["folder"] / f"named-{number}"
        run = subprocess.run(
            [*head, *SMALL, "device=cpu", f"hydra.run.dir={run_dir}"],
            cwd=served["folder"],
            env=served["env"],
            capture_output=True,
            text=True,
            timeout=HANG_GUARD_S,
        )
        assert run.returncode == 0, run.stderr
        assert metrics(run_dir)["served"] is True, head


def test_another_environment_runs_by_itself(served):
    run_dir = served["folder"] / "other"
    process = trainer(
        served, *SMALL, "device=cpu", f"hydra.run.dir={run_dir}", env={"PYTORCH_TEST_SERVE": "1"}
    )
    out, err = process.communicate(timeout=HANG_GUARD_S)
    assert process.returncode == 0, err
    assert metrics(run_dir)["served"] is False


def test_a_tuner_or_benchmark_trial_stays_a_fresh_process_beside_a_server(served):
    """trainer.trials.run_trial's processes are fresh by definition (the tuner's `--trial-start
    fresh`, scripts' rows): they are not handed to the server."""
    run_dir = served["folder"] / "trial"
    command = trials.trainer_command([*SMALL, "device=cpu"], run_dir)
    trial = trials.run_trial(command, run_dir, cwd=served["folder"], env=served["env"])
    assert trial.returncode == 0, trial.stderr
    assert trial.metrics["served"] is False


def started_training(process: subprocess.Popen, run_dir: Path) -> None:
    """Waits until the run has written its first checkpoint-able step (its log names a batch)."""
    deadline = time.monotonic() + HANG_GUARD_S
    log = run_dir / "__main__.log"
    while time.monotonic() < deadline and process.poll() is None:
        if log.is_file() and "batches" in log.read_text():
            return
        time.sleep(0.2)
    raise AssertionError(f"the run did not start training: {process.poll()}")


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill-9"])
def test_a_stopped_or_killed_command_stops_its_run_with_a_checkpoint(served, stop):
    run_dir = served["folder"] / f"stopped-{stop.name}"
    process = trainer(served, *LONG, f"hydra.run.dir={run_dir}", "log_every=1")
    started_training(process, run_dir)
    run_pid = int(metrics_pid(run_dir))
    process.send_signal(stop)
    process.communicate(timeout=HANG_GUARD_S)
    if stop == signal.SIGINT:
        assert process.returncode == 130  # as the run itself ends on Ctrl-C
    assert ends_soon(run_pid)
    assert metrics(run_dir)["status"] == "interrupted"
    assert (run_dir / "checkpoints" / "last.pt").is_file()


def metrics_pid(run_dir: Path) -> int:
    """The run's pid, from the lock it holds on its folder."""
    for lock in run_dir.glob("*.lock"):
        return int(json.loads(lock.read_text())["pid"])
    raise AssertionError(f"no lock in {run_dir}: {sorted(p.name for p in run_dir.iterdir())}")


def test_the_key_follows_import_time_variables_and_the_code(tmp_path, monkeypatch):
    base = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0"}
    key = protocol.environment_key(base)
    assert protocol.environment_key({**base, "CUDA_VISIBLE_DEVICES": "1", "HOME": "/x"}) == key
    assert protocol.environment_key({**base, "TORCHINDUCTOR_MAX_AUTOTUNE": "1"}) != key
    package = tmp_path / "trainer"
    package.mkdir()
    (package / "module.py").write_text("x = 1\n")
    monkeypatch.setattr(protocol, "package_folder", lambda: package)
    before = protocol.environment_key(base)
    os.utime(package / "module.py", ns=(0, 10**9))
    assert protocol.environment_key(base) != before


def test_a_socket_left_by_a_killed_server_is_not_a_server(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINER_SERVE_DIR", str(tmp_path))
    path = protocol.socket_path(protocol.environment_key())
    left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    left.bind(str(path))
    left.close()  # bound, never listening: what a killed server leaves
    assert path.exists() and client.connect() is None


def test_a_served_run_takes_the_commands_umask(served):
    """The umask (as the command's other process settings: trainer/serve/settings.py) is the
    command's, not the server's: the run's log is private under `umask 077`."""
    run_dir = served["folder"] / "umask"
    private = lambda: os.umask(0o077)  # noqa: E731
    process = trainer(served, *SMALL, "device=cpu", f"hydra.run.dir={run_dir}", preexec_fn=private)
    out, err = process.communicate(timeout=HANG_GUARD_S)
    assert process.returncode == 0, err
    assert metrics(run_dir)["served"] is True
    assert (run_dir / "__main__.log").stat().st_mode & 0o777 == 0o600


def test_a_message_the_server_cannot_read_leaves_it_serving(served):
    path = next((served["folder"] / "sockets").glob("*.sock"))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(path))
        sock.sendall(protocol.LENGTH.pack(1) + b"{")  # not JSON
        assert protocol.receive(sock)[0] is None  # dropped
    assert served["server"].poll() is None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:  # and answers the next one
        sock.connect(str(path))
        protocol.send(sock, {"status": True})
        assert protocol.receive(sock)[0]["pid"] == served["server"].pid


def test_a_socket_in_a_folder_others_may_enter_is_not_trusted(tmp_path, monkeypatch):
    """Another user could have made the folder and put a socket there to read the command's
    environment and take its terminal: only a folder of this user's alone counts."""
    folder = tmp_path / "sockets"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    monkeypatch.setenv("TRAINER_SERVE_DIR", str(folder))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(protocol.socket_path(protocol.environment_key())))
    listener.listen(1)
    try:
        assert client.connect() is None
        folder.chmod(0o700)
        answered = client.connect()
        assert answered is not None
        answered.close()
    finally:
        listener.close()


def test_a_stopped_server_ends_and_takes_no_command(served):
    def serve(option: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "trainer.serve", option]
        return subprocess.run(
            command,
            env=served["env"],
            cwd=served["folder"],
            capture_output=True,
            text=True,
            timeout=HANG_GUARD_S,
        )

    assert "serving" in serve("--status").stdout
    stop = serve("--stop")
    assert stop.returncode == 0 and "stopping" in stop.stdout
    assert served["server"].wait(timeout=HANG_GUARD_S) == 0
    assert not list((served["folder"] / "sockets").glob("*.sock"))
