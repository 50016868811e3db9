"""A checkpoint's snapshot (trainer/snapshot.py): the state as of the save, sharing no memory
with the run, storages shared as in the run, host memory kept for the next; and the Saver that
serializes it on its writer's thread."""

from __future__ import annotations

import collections
import threading

import pytest
import torch

from trainer import checkpoint
from trainer.snapshot import StateSnapshot


def test_the_snapshot_keeps_the_values_as_of_the_call():
    weight, history = torch.arange(6.0), [{"epoch": 1}]
    state = {"model": {"weight": weight}, "progress": {"history": history}, "step": 3}
    taken = StateSnapshot().taken(state)

    weight.add_(100)  # the next epoch trains on
    history.append({"epoch": 2})
    history[0]["epoch"] = 99
    assert torch.equal(taken["model"]["weight"], torch.arange(6.0))
    assert taken["progress"]["history"] == [{"epoch": 1}]
    assert taken["step"] == 3
    assert taken["model"]["weight"].untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()


def test_tensors_that_share_a_storage_share_its_copy_as_the_same_views(tmp_path):
    base = torch.arange(12.0)
    tied = {"a": base, "b": base[2:8].view(2, 3), "c": base.view(3, 4).t()}
    taken = StateSnapshot().taken(tied)

    assert taken["b"].untyped_storage().data_ptr() == taken["a"].untyped_storage().data_ptr()
    for name, tensor in tied.items():
        assert taken[name].stride() == tensor.stride() and torch.equal(taken[name], tensor)
    torch.save(taken, tmp_path / "tied.pt")
    loaded = torch.load(tmp_path / "tied.pt", weights_only=True)
    assert loaded["b"].untyped_storage().data_ptr() == loaded["a"].untyped_storage().data_ptr()
    assert torch.equal(loaded["c"], base.view(3, 4).t())


def test_a_module_state_dict_loads_back_strictly_from_its_snapshot():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    taken = StateSnapshot().taken(model.state_dict())

    assert type(taken) is collections.OrderedDict and hasattr(taken, "_metadata")
    fresh = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    fresh.load_state_dict(taken, strict=True)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_the_host_memory_is_kept_for_the_next_snapshot_while_it_fits():
    snapshot, weight = StateSnapshot(), torch.zeros(100)
    first = snapshot.taken({"weight": weight})["weight"]
    weight.add_(1)
    second = snapshot.taken({"weight": weight})["weight"]

    assert second.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()  # no new memory
    assert torch.equal(second, torch.ones(100))
    third = snapshot.taken({"weight": torch.zeros(200)})["weight"]  # grown: made anew
    assert third.numel() == 200 and torch.equal(third, torch.zeros(200))


def test_requires_grad_and_other_tensors_come_through():
    leaf = torch.ones(3, requires_grad=True)
    sparse = torch.eye(3).to_sparse()
    taken = StateSnapshot().taken({"leaf": leaf, "sparse": sparse, "empty": torch.empty(0)})

    assert taken["leaf"].requires_grad and torch.equal(taken["leaf"].detach(), torch.ones(3))
    assert taken["sparse"].is_sparse and torch.equal(taken["sparse"].to_dense(), torch.eye(3))
    assert taken["empty"].numel() == 0


def test_the_saver_writes_the_state_as_of_its_call_while_training_goes_on(tmp_path):
    model, path = torch.nn.Linear(8, 8), tmp_path / "last.pt"
    before = model.weight.detach().clone()
    saver = checkpoint.Saver()
    saver.save(path, {"model": model}, step=1)
    with torch.no_grad():
        model.weight.add_(1)  # before the write is waited for
    saver.wait()

    assert torch.equal(torch.load(path, weights_only=False)["model"]["weight"], before)


def test_a_state_that_cannot_be_serialized_fails_at_the_save_and_leaves_the_last_checkpoint(tmp_path):
    path, saver = tmp_path / "last.pt", checkpoint.Saver()
    saver.save(path, {"model": torch.nn.Linear(2, 2)}, step=1)
    saver.wait()
    written = path.read_bytes()

    with pytest.raises(Exception, match="pickle|lambda"):  # pickled on the caller's thread
        saver.save(path, {"model": torch.nn.Linear(2, 2)}, step=2, hook=lambda: None)
    saver.wait()  # nothing in flight
    assert path.read_bytes() == written
    saver.save(path, {"model": torch.nn.Linear(2, 2)}, step=3)  # the next save goes on
    saver.wait()
    assert torch.load(path, weights_only=False)["step"] == 3


def test_two_storages_over_the_same_memory_are_copied_apart():
    whole = torch.arange(10.0)
    head = torch.from_numpy(whole.numpy()[:5])  # another storage at the same address, shorter
    taken = StateSnapshot().taken({"head": head, "whole": whole})

    assert torch.equal(taken["whole"], torch.arange(10.0)) and torch.equal(taken["head"], torch.arange(5.0))


def test_a_parameter_shares_its_copy_with_its_views():
    weight = torch.nn.Parameter(torch.arange(6.0))
    taken = StateSnapshot().taken({"weight": weight, "view": weight.detach()[1:3]})

    assert taken["view"].untyped_storage().data_ptr() == taken["weight"].untyped_storage().data_ptr()
    assert torch.equal(taken["view"], torch.tensor([1.0, 2.0]))


def test_an_interrupted_wait_leaves_the_write_to_the_next_wait(tmp_path):
    """The snapshot's memory is the writer's until its write is done: a wait that Ctrl-C stops
    does not let the next save write over it."""
    path, saver = tmp_path / "last.pt", checkpoint.Saver()
    release, write = threading.Event(), saver._write
    saver._write = lambda *args: (release.wait(), write(*args))[1]  # the write still under way
    saver.save(path, {"model": torch.nn.Linear(2, 2)}, step=1)
    pending = saver._pending

    def interrupted(*args):
        raise KeyboardInterrupt

    pending.result = interrupted
    with pytest.raises(KeyboardInterrupt):
        saver.wait()
    del pending.result
    assert saver._pending is pending  # still the writer's
    release.set()
    saver.wait()
    assert saver._pending is None and torch.load(path, weights_only=False)["step"] == 1


def test_a_failing_run_logs_a_checkpoint_its_writer_failed_to_write(tmp_path, caplog):
    """Whatever stopped the writer (here an error of its own, not a refused write) is logged:
    the failing run's own error is the one it raises."""
    saver = checkpoint.Saver()

    def failing(*args):
        raise RuntimeError("the writer failed")

    saver._write = failing
    saver.save(tmp_path / "last.pt", {"model": torch.nn.Linear(2, 2)}, step=1)
    saver.wait_logging_refusal()
    assert "the last checkpoint was not written: RuntimeError: the writer failed" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="copies from a GPU: needs a CUDA GPU")
def test_a_gpu_state_is_written_as_of_the_save_though_its_copies_are_not_waited_for(tmp_path):
    """The copies are ordered on the GPU's stream before the work queued after the save."""
    model, path = torch.nn.Linear(2048, 2048).cuda(), tmp_path / "last.pt"
    before = model.weight.detach().cpu()
    saver = checkpoint.Saver()
    saver.save(path, {"model": model}, step=1)
    with torch.no_grad():
        for _ in range(50):  # queued behind the copies, on the same stream
            model.weight.mul_(1.5)
    saver.wait()

    assert torch.equal(torch.load(path, weights_only=False)["model"]["weight"], before)
