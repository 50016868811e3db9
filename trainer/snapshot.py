"""A checkpoint's state taken off the training: its containers rebuilt and its tensors copied
into host memory kept from one checkpoint to the next, so that the writer's thread can serialize
it while the next epoch trains.

Serialized on the training thread at each epoch's end, a ResNet-18 checkpoint (134 MB) held
that thread, the GPU idle, for 50 ms per epoch on an H200 host: 0.7 s of a 14-epoch run
(py-spy, recipe=resnet18_94, outputs/readme/gpu_h200_2026-11-28d.md), most of it torch's zip
writer and one synchronizing copy per storage. Taking the snapshot costs one copy of each
storage into host memory, page-locked for the GPU's, so they go as one batch that the training
thread does not wait for: the writer's thread waits for it (`copied`) before it writes the
bytes (trainer/serialize.py).

Storages are copied once each, and each tensor is made again as the same view of its copy:
tensors that share a storage (tied weights, views) still share one in the file, as torch.save
writes them.

Owns: the copy of a checkpoint's state and the host memory it is made in. Must not touch: what
a checkpoint holds (trainer/checkpoint.py), how it becomes bytes (trainer/serialize.py).
"""

from __future__ import annotations

import copy


class StateSnapshot:
    """`taken(state)`: the state as of the call, sharing no memory with it. The host memory of
    the last snapshot is written over by the next: its serialization must be done first
    (checkpoint.Saver waits for its last write before taking another). The GPU's copies are
    ordered on its current stream, before any later work there changes the state."""

    def __init__(self) -> None:
        self._host: list[tuple] = []  # (host storage, page-locked), in the order the state's storages are met
        self._copying: list = []  # the last snapshot's copies from the GPUs: (device, event) per GPU
        self.blocks: dict[int, int] = {}  # the last snapshot's host storages but empty ones: address -> bytes

    def taken(self, state: object, wait: bool = True) -> object:
        """The snapshot; its copies from a GPU still under way where not `wait`: `copied` waits
        for them (the host memory is not to be read before)."""
        import torch

        copies: dict[tuple, object] = {}  # (device, the storage) -> its host copy
        snapshot = self._rebuilt(state, copies)
        self.blocks = {host.data_ptr(): host.nbytes() for host in copies.values() if host.nbytes()}
        devices = {key[0] for key in copies if key[0].type == "cuda"}
        self._copying = []
        for device in devices:  # the copies went without waiting: one event per GPU
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._copying.append((device, event))
        if wait:
            self.copied()
        return snapshot

    def copied(self) -> None:
        """Until the last snapshot's copies from the GPUs are in host memory (Python's lock let
        go while waiting)."""
        import torch

        for device, event in self._copying:
            with torch.cuda.device(device):  # on a new thread: not a context made on GPU 0 to wait
                event.synchronize()

    def _rebuilt(self, value: object, copies: dict) -> object:
        import torch

        if isinstance(value, torch.Tensor):
            return self._tensor(value, copies)
        if isinstance(value, dict):
            rebuilt = {key: self._rebuilt(item, copies) for key, item in value.items()}
            return rebuilt if type(value) is dict else _same_type(value, rebuilt)
        if isinstance(value, list):
            return [self._rebuilt(item, copies) for item in value]
        if type(value) is tuple:
            return tuple(self._rebuilt(item, copies) for item in value)
        return copy.deepcopy(value)  # numbers, strings, numpy's RNG state: none shares the run's memory

    def _tensor(self, tensor, copies: dict):
        import torch

        plain = (
            type(tensor) in (torch.Tensor, torch.nn.Parameter)
            and tensor.layout is torch.strided
            and tensor.device.type in ("cpu", "cuda")
        )
        if not plain or tensor.is_quantized or tensor.is_conj() or tensor.is_neg():
            # sparse, quantized, subclasses, other devices: copied on their own, as torch.save would
            return tensor.detach() if tensor.is_meta else tensor.detach().to("cpu", copy=True)
        storage = tensor.untyped_storage()
        key = (tensor.device, storage._cdata)  # the storage itself, as torch.save tells them apart
        if key not in copies:
            host = self._host_storage(len(copies), storage.nbytes(), tensor.device.type == "cuda")
            source = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
            torch.empty(0, dtype=torch.uint8).set_(host).copy_(source, non_blocking=True)
            copies[key] = host
        view = torch.empty(0, dtype=tensor.dtype).set_(
            copies[key], tensor.storage_offset(), tensor.size(), tensor.stride()
        )
        return view.requires_grad_() if tensor.requires_grad else view

    def _host_storage(self, index: int, nbytes: int, pinned: bool):
        """The index-th host storage, made anew where the last snapshot's does not fit."""
        import torch

        if (
            index < len(self._host)
            and self._host[index][0].nbytes() == nbytes
            and self._host[index][1] == pinned
        ):
            return self._host[index][0]
        made = (torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned).untyped_storage(), pinned)
        if index < len(self._host):
            self._host[index] = made
        else:
            self._host.append(made)
        return made[0]


def _same_type(original: dict, rebuilt: dict) -> dict:
    """A dict subclass (OrderedDict, a state_dict with _metadata) as the same type, its
    attributes copied."""
    result = copy.copy(original)  # the same type with its attributes (a state_dict's _metadata)
    result.clear()
    result.update(rebuilt)
    return result
