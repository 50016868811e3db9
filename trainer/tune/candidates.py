"""The toggles the tuner tries, and which of them can act on a device.

Owns: the candidate list (a name, the overrides that turn it on, the group of alternatives it
belongs to, what it needs) and the split into the ones a device can try and the ones it cannot,
with the reason. Must not touch: measuring (bench.py) or deciding (search.py), or how a run
applies a toggle (trainer.perf).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.report.jobs import parse_override


@dataclass(frozen=True)
class Candidate:
    name: str  # how tables and tuned.yaml call it
    overrides: tuple[str, ...]  # what turns it on, on top of perf=default
    group: str = ""  # at most one candidate of a group is kept (alternatives of one key)
    needs_cuda: bool = False
    built_in_models_only: bool = False

    @property
    def keys(self) -> set[str]:
        return {parse_override(override)[0] for override in self.overrides}


# perf=default already feeds the device (DataLoader workers, pinned memory, non-blocking
# copies): these are the optimizations on top, as in perf=fast.
CANDIDATES = (
    Candidate("amp", ("amp=true",)),
    Candidate("channels_last", ("channels_last=true",)),
    Candidate("set_to_none", ("set_to_none=true",)),
    Candidate("compile", ("compile=true",), group="compile"),
    # CUDA graphs replay fixed gradient buffers: the trainer refuses them without set_to_none
    Candidate(
        "compile_mode=reduce_overhead",
        ("compile=true", "compile_mode=reduce_overhead", "set_to_none=true"),
        group="compile",
        needs_cuda=True,
    ),
    Candidate("cudnn_benchmark", ("cudnn_benchmark=true",), needs_cuda=True),
    Candidate("tf32", ("tf32=true",), needs_cuda=True),
    Candidate("fused_optimizer", ("fused_optimizer=true",), needs_cuda=True),
    Candidate("step_graph", ("step_graph=true",), needs_cuda=True),
    Candidate("data.loader=gpu", ("data.loader=gpu",), needs_cuda=True),
    Candidate("model.conv_bias=false", ("model.conv_bias=false",), built_in_models_only=True),
)
NAMES = tuple(candidate.name for candidate in CANDIDATES)


@dataclass
class Split:
    tryable: list[Candidate] = field(default_factory=list)
    not_tried: dict[str, str] = field(default_factory=dict)  # name -> why


def split_for(candidates: list[Candidate], device: str, custom_model: bool, fixed_keys: set[str]) -> Split:
    """The candidates this run can try; for the others, why not (one phrase each)."""
    split = Split()
    for candidate in candidates:
        if candidate.needs_cuda and device != "cuda":
            split.not_tried[candidate.name] = f"needs a CUDA device, the run's is {device}"
        elif candidate.built_in_models_only and custom_model:
            split.not_tried[candidate.name] = "acts on the built-in models only (model.target is set)"
        elif candidate.keys & fixed_keys:
            keys = ", ".join(sorted(candidate.keys & fixed_keys))
            split.not_tried[candidate.name] = f"set on the command line ({keys})"
        else:
            split.tryable.append(candidate)
    return split


def pick(names: str | None) -> list[Candidate]:
    """The candidates named in a comma-separated list (all when None); ValueError names the
    unknown ones and the known."""
    if names is None:
        return list(CANDIDATES)
    wanted = [name.strip() for name in names.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in NAMES]
    if unknown or not wanted:
        raise ValueError(
            f"unknown toggle(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(NAMES)}"
        )
    return [candidate for candidate in CANDIDATES if candidate.name in wanted]
