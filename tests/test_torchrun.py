"""DDP started by torchrun: its ranks join the group it made and share one run folder, two
"nodes" on localhost give the weights of one node, and sweeps under torchrun are refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import HANG_GUARD_S, SMALL, cli_environment, read_metrics, run_folders
from test_ddp import model_tensors

from trainer.distributed import free_port


def torchrun(*args: str, cwd: Path, nodes: int = 1) -> subprocess.CompletedProcess:
    """torchrun with 2 processes: on one node, or one on each of `nodes`=2 "nodes" on localhost
    (two torchrun agents meeting at a c10d rendezvous, as on two hosts)."""
    environment = cli_environment()
    run = [sys.executable, "-m", "torch.distributed.run"]
    if nodes == 1:
        command = [*run, "--nproc_per_node=2", "-m", "trainer", *args]
        return subprocess.run(
            command, cwd=cwd, env=environment, capture_output=True, text=True, timeout=HANG_GUARD_S
        )
    endpoint = f"127.0.0.1:{free_port()}"
    rendezvous = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}"]
    agents = [
        subprocess.Popen(
            [*run, *rendezvous, "--rdzv_id=two-nodes", "-m", "trainer", *args],
            cwd=cwd,
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(nodes)
    ]
    outputs = [agent.communicate(timeout=HANG_GUARD_S) for agent in agents]
    failed = next((i for i, agent in enumerate(agents) if agent.returncode), None)
    index = 0 if failed is None else failed
    return subprocess.CompletedProcess(agents[index].args, agents[index].returncode, *outputs[index])


@pytest.fixture(scope="module")
def torchrun_one_node(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("torchrun")
    result = torchrun(*SMALL, "ddp=true", "deterministic=true", cwd=cwd)
    assert result.returncode == 0, result.stderr[-2000:]
    [run] = run_folders(cwd / "outputs")
    return run


def test_torchrun_ranks_join_its_group_and_share_one_run_folder(torchrun_one_node):
    metrics = read_metrics(torchrun_one_node)
    assert (metrics["status"], metrics["world_size"]) == ("completed", 2)
    assert (torchrun_one_node / "rank1.log").is_file()
    assert (torchrun_one_node / "checkpoints" / "last.pt").is_file()


def test_two_torchrun_nodes_match_one_node_of_two_processes(tmp_path, torchrun_one_node):
    result = torchrun(*SMALL, "ddp=true", "deterministic=true", cwd=tmp_path, nodes=2)
    assert result.returncode == 0, result.stderr[-2000:]
    [run] = run_folders(tmp_path / "outputs")
    assert (read_metrics(run)["status"], read_metrics(run)["world_size"]) == ("completed", 2)
    for name, tensor in model_tensors(torchrun_one_node).items():
        torch.testing.assert_close(model_tensors(run)[name], tensor, rtol=0, atol=0, msg=name)


def test_sweeps_under_torchrun_are_refused(tmp_path):
    result = torchrun("-m", *SMALL, "ddp=true", "seed=0,1", cwd=tmp_path)
    assert result.returncode != 0
    assert "sweeps (-m) under torchrun are not supported" in result.stderr
    assert not (tmp_path / "outputs").exists()
