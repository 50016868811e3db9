"""A checkpoint's bytes (trainer/serialize.py): a torch zip without CRC-32s that torch.load
reads, the snapshot's storages kept as views of it and read only by the writer, torch's own
setting left as it was."""

from __future__ import annotations

import io
import zipfile

import torch

from trainer import checkpoint, serialize
from trainer.serialize import address, serialized
from trainer.snapshot import StateSnapshot


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


def test_the_storages_bytes_are_kept_as_views_of_the_snapshot_unread():
    """torch.save runs on the caller's thread and reads no storage of the snapshot: the writer
    reads them once the copies are done. What it writes is torch.save's file, byte for byte."""
    snapshots = StateSnapshot()
    state = {"weight": torch.arange(1000.0), "names": ["a", "b"], "step": 3}
    taken = snapshots.taken(state)
    waited = []
    parts = serialized(taken, snapshots.blocks, lambda: waited.append(True))

    storage = taken["weight"].untyped_storage()
    views = [part for part in parts if isinstance(part, memoryview)]
    assert [address(view) for view in views] == [storage.data_ptr()]
    assert not waited  # no copy was needed: nothing was read early
    taken["weight"].add_(1)  # the copy lands after the pickling: the file has what is there then
    assert torch.equal(loaded(b"".join(parts))["weight"], torch.arange(1000.0) + 1)
    with serialize.without_zip_checksum():
        direct = io.BytesIO()
        torch.save(taken, direct)
    assert b"".join(parts) == direct.getvalue()


def test_a_block_torch_did_not_hand_over_whole_is_made_again_after_the_copies(monkeypatch):
    """Where torch's writer met a storage otherwise than as one write of it (another torch), it
    may have read it before its copy landed: the bytes are made again once copied."""
    snapshots = StateSnapshot()
    taken = snapshots.taken({"weight": torch.arange(1000.0)})
    monkeypatch.setattr(serialize, "address", lambda view: -1)  # no write matches a block
    waited = []
    parts = serialized(taken, snapshots.blocks, lambda: waited.append(True))

    assert waited == [True]
    assert not any(isinstance(part, memoryview) for part in parts)
    assert torch.equal(loaded(b"".join(parts))["weight"], torch.arange(1000.0))


def test_an_empty_storage_and_a_large_pickle_come_through():
    snapshots = StateSnapshot()
    state = {"names": [f"name {index}" for index in range(20_000)], "empty": torch.zeros(0)}
    taken = snapshots.taken(state)
    restored = loaded(b"".join(serialized(taken, snapshots.blocks, lambda: None)))
    assert restored["names"][-1] == "name 19999" and restored["empty"].numel() == 0


def test_where_torch_has_no_checksum_switch_the_copies_are_waited_for_first(monkeypatch):
    """Before torch 2.6 its writer computes each record's CRC-32, reading the storage's bytes."""
    snapshots = StateSnapshot()
    taken = snapshots.taken({"weight": torch.arange(10.0)})
    monkeypatch.setattr(serialize, "without_zip_checksum", lambda: None)
    order, save = [], torch.save
    monkeypatch.setattr(torch, "save", lambda *args: (order.append("save"), save(*args))[1])
    parts = serialized(taken, snapshots.blocks, lambda: order.append("copied"))

    assert order[:2] == ["copied", "save"]
    assert torch.equal(loaded(b"".join(parts))["weight"], torch.arange(10.0))
