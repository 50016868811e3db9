"""A checkpoint's bytes (trainer/serialize.py): a torch zip without CRC-32s that torch.load
reads, torch's own setting left as it was."""

from __future__ import annotations

import io
import zipfile

import torch

from trainer import checkpoint
from trainer.serialize import serialized


def test_a_checkpoint_is_written_without_crc32s_and_loads(tmp_path):
    model, path = torch.nn.Linear(64, 64), tmp_path / "last.pt"
    saver = checkpoint.Saver()
    saver.save(path, {"model": model}, step=1)
    saver.wait()

    records = zipfile.ZipFile(path).infolist()
    assert records and all(record.CRC == 0 for record in records)
    assert torch.equal(torch.load(path, weights_only=False)["model"]["weight"], model.weight.detach())
    with zipfile.ZipFile(serialized_default(model)) as default:  # torch's own default, for contrast
        assert any(record.CRC != 0 for record in default.infolist())


def serialized_default(model) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict()}, buffer)
    buffer.seek(0)
    return buffer


def test_serialized_leaves_torchs_setting_as_it_was():
    from torch.utils.serialization import config

    serialized({"x": torch.zeros(3)})
    assert config.save.compute_crc32 is True
