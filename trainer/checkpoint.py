"""Atomic checkpoints (trainer.atomic) and resume.

torch and numpy are imported where they are used: `resolve_checkpoint` is part of the
command-line check, which answers before torch is loaded.

Owns: the checkpoint file (what it holds, CONTENTS), saving and loading it, the RNG states,
and the checks that a checkpoint fits the run resuming from it. Must not touch: when to save
or restore (trainer/run.py), the parts whose states it holds.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from trainer.atomic import NotWritten, remove_leftovers, write_atomic
from trainer.config import ConfigError, TrainerError
from trainer.serialize import serialized
from trainer.snapshot import StateSnapshot

log = logging.getLogger(__name__)

CHECKPOINT = Path("checkpoints") / "last.pt"
# What every checkpoint this trainer writes holds (besides the optional `classes`).
CONTENTS = ("model", "optimizer", "scheduler", "scaler", "progress", "rng", "config", "total_steps")


# A checkpoint that could not be written (full disk, file-size limit): one line, the old one kept.
CheckpointNotWritten = NotWritten


class Saver:
    """A run's checkpoints, each taken off the training on the caller's thread (a snapshot: the
    file holds the state as of the call, trainer/snapshot.py) and pickled there without waiting
    for the GPU's copies, then written to disk on a thread of its own while training goes on,
    one at a time (trainer/serialize.py says why the work is split so). Written in place, a
    ResNet-18 run's 14 checkpoints held its training thread for 1.5 s on an H100 host, most of it
    fsync and the rename over the last file (outputs/readme/gpu_h100x2_2026-11-26h.md); then
    serialized in place, 0.7 s on an H200 host. `wait` returns once the last one is on disk and
    raises what stopped it (NotWritten, one line, where the disk refused it); the run waits
    before its next save, its next record, a stop's resume hint and its end, so nothing it
    reports is still in flight."""

    def __init__(self) -> None:
        self._pending: Future | None = None
        self._snapshot = StateSnapshot()  # its memory written over by each save, after the last write

    def save(self, path: Path, stateful: dict, **extra) -> None:
        """state_of(stateful, extra) into `path`, atomically (trainer.atomic), once this returns
        and `wait` has. A state that torch.save cannot pickle raises here."""
        self.wait()
        snapshot = self._snapshot.taken(state_of(stateful, extra), wait=False)
        try:
            parts = serialized(snapshot, self._snapshot.blocks, self._snapshot.copied)  # its bytes unread
        except BaseException:
            self._snapshot.copied()  # no copy left in flight into memory the next save writes
            raise
        writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._pending = writer.submit(self._write, path, parts)
        writer.shutdown(wait=False)  # its thread ends once the write has

    def _write(self, path: Path, parts: list) -> None:
        self._snapshot.copied()
        write_atomic(path, parts, "the checkpoint")

    def wait(self) -> None:
        pending = self._pending
        if pending is None:
            return
        try:
            pending.result()
        finally:
            if pending.done():  # an interrupted wait leaves it to the next: its memory is in use
                self._pending = None

    def wait_logging_refusal(self) -> None:
        """wait() for a run that is failing already: its own error is the one raised, a
        checkpoint that failed (a refused write, a state its writer could not serialize) is
        logged."""
        try:
            self.wait()
        except NotWritten as refused:
            log.error("%s", refused)
        except Exception as failed:  # the writer's serialization: logged in one line, not raised
            log.error("the last checkpoint was not written: %s: %s", type(failed).__name__, failed)


def seed_rngs(seed: int) -> None:
    """Python's, numpy's and torch's random numbers from `seed` (a run's start)."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_states() -> dict:
    import numpy as np
    import torch

    states = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(states["torch"])
    np.random.set_state(states["numpy"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def resolve_checkpoint(resume: str) -> Path:
    """A checkpoint file, or a run folder holding checkpoints/last.pt."""
    path = Path(os.path.expanduser(resume))
    if path.is_dir():
        path = path / CHECKPOINT
    if not path.is_file():
        raise TrainerError(
            f"resume={resume}: no checkpoint at {path}. Give a checkpoint file or a run folder "
            f"that holds {CHECKPOINT} (e.g. resume=outputs/<overrides>/<date>_<time>)"
        )
    return path


def load_checkpoint(resume: str) -> tuple[Path, dict]:
    """The resolved checkpoint file and what it holds."""
    import torch

    path = resolve_checkpoint(resume)
    remove_leftovers(path)  # a save killed midway never became a checkpoint
    try:
        return path, torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:
        raise TrainerError(f"resume={resume}: {path} is not a readable checkpoint ({error})") from None


def state_of(stateful: dict, extra: dict) -> dict:
    """What a checkpoint holds: the state_dict of each named object, the RNG states and `extra`."""
    return {**{name: obj.state_dict() for name, obj in stateful.items()}, "rng": rng_states(), **extra}


def restore(resume: str, state: dict, stateful: dict) -> None:
    for name, obj in stateful.items():
        try:
            obj.load_state_dict(state[name])
        except (KeyError, ValueError, RuntimeError) as error:  # torch's messages span lines
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ConfigError(
                f"resume={resume}: the saved {name} state does not fit this run ({reason}): resume with "
                "the settings it was saved with (its .hydra/overrides.yaml), or start a new run"
            ) from None
    restore_rng_states(state["rng"])


# Saved settings that decide the shape of what a checkpoint holds, with the override that sets each.
STATE_SHAPING = {
    ("model", "name"): "model",
    ("model", "target"): "model.target",
    ("optim", "name"): "optim",
    ("optim", "schedule"): "optim.schedule",
    ("ema", "enabled"): "ema.enabled",
}


# Settings whose effect a resume takes from the checkpoint, not from the config: the
# optimizer's hyperparameters and flags (torch loads its param_groups as saved), the schedule's
# shape (the scheduler's state), what only the initial weights see (those are loaded) and the
# seed (the RNG states are loaded). A resume that changed one would record the new value and
# train with the saved one (optim.lr=0.5 logged and written as a peak of 0.125 while training
# went on at the checkpoint's 0.025), so it is refused, naming the setting. The schema's other
# settings apply as given; tests/test_resume_checks.py holds every field to one of the lists.
RESTORED_SETTINGS = (
    "optim.lr",
    "optim.lr_base_batch",
    "optim.lr_scaling",
    "optim.momentum",
    "optim.nesterov",
    "optim.weight_decay",
    "optim.betas",
    "optim.warmup_frac",
    "optim.lr_start_frac",
    "optim.norm_bias_lr_scale",
    "optim.muon_lr",
    "optim.muon_momentum",
    "optim.muon_weight_decay",
    "optim.muon_ns_steps",
    "optim.early_epochs",
    "model.sgd_lr",
    "model.zero_init_residual",
    "fused_optimizer",
    "seed",
)


def dotted(config: dict, key: str, default=None):
    for part in key.split("."):
        if not isinstance(config, dict) or part not in config:
            return default
        config = config[part]
    return config


def shown(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def changed_settings(saved: dict, config: dict, keys: Iterable[str]) -> list[tuple[str, object, object]]:
    """(key, saved value, this config's) for each of `keys` whose value differs; a key the saved
    config lacks (an older run's) is not compared."""
    missing = object()
    changed = []
    for key in keys:
        saved_value, value = dotted(saved, key, missing), dotted(config, key)
        if saved_value is not missing and saved_value != value:
            changed.append((key, saved_value, value))
    return changed


def check_restored_settings(resume: str, saved: dict, config: dict) -> None:
    for key, saved_value, value in changed_settings(saved, config, RESTORED_SETTINGS)[:1]:
        raise ConfigError(
            f"resume={resume} was saved with {key}={shown(saved_value)}, this config has "
            f"{shown(value)}: a resume trains with the checkpoint's {key}, so set "
            f"{key}={shown(saved_value)}, or start a new run without resume"
        )


def check_compatible(
    state: dict, config: dict, total_steps: int, model_state: dict, classes: list[str]
) -> None:
    """Resuming needs a checkpoint of this trainer, of the same model and optimizer, trained on
    as many classes, with the same LR schedule and schedule length."""
    resume = config["resume"]
    missing = [key for key in CONTENTS if key not in state]
    if missing:
        raise ConfigError(
            f"resume={resume} is not a checkpoint written by this trainer (no {', '.join(missing)} in it): "
            f"give a run folder or its {CHECKPOINT}"
        )
    saved = state["config"]
    for (group, key), override in STATE_SHAPING.items():
        value = saved.get(group, {}).get(key, config[group].get(key))  # older checkpoints lack newer keys
        if value != config[group].get(key):
            value = str(value).lower() if isinstance(value, bool) else value
            raise ConfigError(
                f"resume={resume} was saved with {group}.{key}={value}, this config has "
                f"{config[group].get(key)}: set {override}={value}"
            )
    check_restored_settings(resume, saved, config)
    saved_classes = state.get("classes")
    if saved_classes is not None and len(saved_classes) != len(classes):
        data = saved["data"]
        fix = f"data={data['source']}" + (f" data.root={data['root']}" if data["root"] else "")
        raise ConfigError(
            f"resume={resume} was trained on {len(saved_classes)} classes, this data has {len(classes)}: "
            f"resume on the data it was trained on ({fix})"
        )
    check_same_tensors(resume, saved, config, state["model"], model_state)
    if state["total_steps"] != total_steps:
        limit = f" max_steps={saved['max_steps']}" if saved["max_steps"] is not None else ""
        raise ConfigError(
            f"resume={resume} continues a {state['total_steps']}-step schedule, this config makes "
            f"{total_steps} steps: set epochs={saved['epochs']}{limit} "
            f"batch_size={saved['batch_size']} as saved, or start a new run without resume"
        )


def check_same_tensors(resume: str, saved: dict, config: dict, saved_state: dict, model_state: dict) -> None:
    """The saved weights have the names and shapes of this model's."""
    saved_shapes = {name: tuple(tensor.shape) for name, tensor in saved_state.items()}
    shapes = {name: tuple(tensor.shape) for name, tensor in model_state.items()}
    if saved_shapes == shapes:
        return
    conv_bias = saved["model"]["conv_bias"]
    if conv_bias != config["model"]["conv_bias"]:
        raise ConfigError(
            f"resume={resume} was saved with model.conv_bias={str(conv_bias).lower()}, a different set of "
            f"weights: set model.conv_bias={str(conv_bias).lower()}"
        )
    differing = sorted(set(saved_shapes) ^ set(shapes)) or sorted(
        name for name in shapes if saved_shapes[name] != shapes[name]
    )
    name = differing[0]
    raise ConfigError(
        f"resume={resume}: the saved model does not fit this one ({name}: {saved_shapes.get(name)} saved, "
        f"{shapes.get(name)} here): resume with the settings and data it was saved with "
        "(its .hydra/overrides.yaml), or start a new run"
    )
