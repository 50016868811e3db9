"""What a composed config needs of this machine, checked before a run folder exists and before
torch is imported: the data where data.root says, a GPU where device asks for one, and a run
being resumed that was saved with the same length of schedule.

Each check is the early copy of one the run makes again once torch is loaded (the data
sources, assembly.resolve_device, checkpoint.check_compatible): those still catch what only
torch can see (a CUDA build of torch, an intact download, the saved tensors). The messages are
defined here, once, for both.

Must not touch: torch, the run folder, the config's own validation (trainer/config_checks.py).
"""

from __future__ import annotations

import functools
import glob
import os
import socket
import threading
from pathlib import Path

from omegaconf import OmegaConf

from trainer.checkpoint import RESTORED_SETTINGS, STATE_SHAPING, changed_settings, resolve_checkpoint, shown
from trainer.config import ConfigError, DataSource, TrainConfig

CIFAR10_FOLDER = "cifar-10-batches-py"
CIFAR10_FILES = ("batches.meta", "test_batch", *(f"data_batch_{i}" for i in range(1, 6)))
CIFAR10_ARCHIVE = "cifar-10-python.tar.gz"
CIFAR10_HOST = "www.cs.toronto.edu"  # where torchvision downloads CIFAR-10 from
PROBE_S = 1.5  # for the name lookup and again for the connection
# A GPU driver's device files: NVIDIA's, Jetson's, ROCm's (torch.cuda on AMD), WSL2's
DRIVER_FILES = ("/dev/nvidia[0-9]*", "/dev/nvhost-ctrl-gpu", "/dev/kfd", "/dev/dxg")
# Settings a resumed run must share with the run it continues: the schedule's length in steps
# (with the data, checked once loaded), the shape of what the checkpoint holds, and what the
# checkpoint's state decides (checkpoint.RESTORED_SETTINGS).
RESUMED_AS_SAVED = (
    "epochs",
    "max_steps",
    "batch_size",
    "grad_accum_steps",
    *(f"{group}.{key}" for group, key in STATE_SHAPING),
    *RESTORED_SETTINGS,
)


def check_machine(cfg: TrainConfig) -> None:
    """ConfigError in one line naming the fix, where this machine cannot run `cfg`."""
    check_device(cfg.device)
    check_data(cfg)
    if cfg.resume:
        check_resumed_settings(cfg)


def no_cuda_device(spec: str) -> str:
    return f"device={spec} but no CUDA device is visible: use device=cpu or device=auto"


def check_device(spec: str) -> None:
    """device=cuda on a machine with no GPU driver, or with every GPU hidden."""
    if not spec.startswith("cuda"):
        return
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1")
    drivers = [path for pattern in DRIVER_FILES for path in glob.glob(pattern)]
    if hidden or not drivers:
        raise ConfigError(no_cuda_device(spec))


def cifar10_missing(root: Path, why: str) -> str:
    return (
        f"CIFAR-10 not found in {root.resolve()} ({why}). Fix: "
        "data.root=/path/to/folder-with-cifar-10-batches-py, or "
        "data=imagefolder data.root=/path/to/class-folders, or data=synthetic"
    )


def imagefolder_missing(folder: Path, reason: str) -> str:
    return (
        f"no class folders in {folder.resolve()} ({reason}). Fix: "
        "data.root=/path/with/train/<class>/ and test/<class>/ image folders, "
        "or data=cifar10, or data=synthetic"
    )


def check_data(cfg: TrainConfig) -> None:
    root = Path(os.path.expanduser(cfg.data.root)) if cfg.data.root else None
    if cfg.data.source is DataSource.imagefolder and root is not None:
        for split in ("train", "test"):
            folder = root / split
            if not folder.is_dir():
                raise ConfigError(imagefolder_missing(folder, f"no folder {folder}"))
            if not any(entry.is_dir() for entry in folder.iterdir()):
                raise ConfigError(imagefolder_missing(folder, "it holds no class folder"))
    if cfg.data.source is DataSource.cifar10 and root is not None:
        batches = root / CIFAR10_FOLDER
        if all((batches / name).is_file() for name in CIFAR10_FILES) or (root / CIFAR10_ARCHIVE).is_file():
            return  # the archive alone is extracted without a download (its checksum checked then)
        if not cfg.data.download:
            raise ConfigError(cifar10_missing(root, f"no {CIFAR10_FOLDER} there and data.download=false"))
        if not reachable(CIFAR10_HOST):
            raise ConfigError(
                cifar10_missing(
                    root, f"no {CIFAR10_FOLDER} there, and {CIFAR10_HOST} cannot be reached to download it"
                )
            )


@functools.cache
def reachable(host: str, port: int = 443) -> bool:
    """Whether a connection to host opens within PROBE_S (a name lookup has no timeout of its
    own: it runs in a thread that is left behind if it takes longer). Behind a proxy (its
    variables set) nothing is known here, and the download is left to try."""
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    found: list = []
    lookup = threading.Thread(target=lambda: found.append(addresses(host, port)), daemon=True)
    lookup.start()
    lookup.join(PROBE_S)
    for address in found[0] if found else []:  # each, as urllib falls back from IPv6 to IPv4
        try:
            socket.create_connection(address, timeout=PROBE_S).close()
            return True
        except OSError:
            continue
    return False


def addresses(host: str, port: int) -> list[tuple]:
    try:
        return [info[4][:2] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)][:3]
    except OSError:
        return []


def check_resumed_settings(cfg: TrainConfig) -> None:
    """The resumed run's saved settings (its .hydra/config.yaml, beside checkpoints/) against
    this config's; a checkpoint outside a run folder is checked once loaded."""
    checkpoint = resolve_checkpoint(cfg.resume)
    saved_file = checkpoint.parent.parent / ".hydra" / "config.yaml"
    if not saved_file.is_file():
        return
    try:
        saved = OmegaConf.to_container(OmegaConf.load(saved_file), resolve=True)
    except Exception:  # unreadable: the checkpoint's own copy is checked once loaded
        return
    here = OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
    differing = [
        f"{key}={shown(saved_value)}"
        for key, saved_value, _ in changed_settings(saved, here, RESUMED_AS_SAVED)
    ]
    if differing:
        raise ConfigError(
            f"resume={cfg.resume} was saved with {' '.join(differing)}, which this config changes: "
            f"set {' '.join(differing)} as saved, or start a new run without resume"
        )
