"""A checkpoint's bytes (trainer/serialize.py): a torch zip without CRC-32s that torch.load
reads, made in memory kept from one checkpoint to the next, torch's own setting left as it was."""

from __future__ import annotations

import io
import zipfile

import torch

from trainer import checkpoint
from trainer.serialize import CheckpointBuffer, storage_bytes


def loaded(data) -> dict:
    return torch.load(io.BytesIO(bytes(data)), weights_only=True)


def test_a_checkpoint_is_written_without_crc32s_and_loads(tmp_path):
    model, path = torch.nn.Linear(64, 64), tmp_path / "last.pt"
    saver = checkpoint.Saver()
    saver.save(path, {"model": model}, step=1)
    saver.wait()

    records = zipfile.ZipFile(path).infolist()
    assert records and all(record.CRC == 0 for record in records)
    assert torch.equal(torch.load(path, weights_only=False)["model"]["weight"], model.weight.detach())
    default = io.BytesIO()
    torch.save({"model": model.state_dict()}, default)  # torch's own default, for contrast
    assert any(record.CRC != 0 for record in zipfile.ZipFile(default).infolist())


def test_the_memory_is_kept_for_the_next_checkpoint_and_grows_when_the_state_does():
    from torch.utils.serialization import config

    buffer, weight = CheckpointBuffer(), torch.arange(1000.0)
    first = bytes(buffer.serialized({"weight": weight}))
    memory = buffer.memory
    weight.add_(1.0)
    second = buffer.serialized({"weight": weight})

    assert buffer.memory is memory  # written over, not made anew
    assert torch.equal(loaded(first)["weight"], torch.arange(1000.0))
    assert torch.equal(loaded(second)["weight"], torch.arange(1000.0) + 1)
    larger = buffer.serialized({"weight": weight, "more": torch.ones(1_000_000)})
    assert buffer.memory is not memory and torch.equal(loaded(larger)["more"], torch.ones(1_000_000))
    assert config.save.compute_crc32 is True  # torch's setting as it was


def test_more_than_expected_is_kept_whole():
    buffer = CheckpointBuffer()
    buffer.serialized({"small": torch.zeros(10)})
    state = {"names": [f"name {index}" for index in range(20_000)], "weight": torch.zeros(10)}
    assert loaded(buffer.serialized(state))["names"][-1] == "name 19999"  # pickled data beyond the estimate


def test_the_size_counts_each_storage_once():
    whole = torch.zeros(1000)
    assert storage_bytes({"a": whole[:10], "b": [whole[10:20], whole]}) == whole.nbytes
