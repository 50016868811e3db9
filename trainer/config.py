"""The one typed schema. Every field is documented here and only here.

YAML files under conf/ hold presets that differ from these defaults. Checks that
span several fields live in ``__post_init__``; they run when a composed config is
turned into these dataclasses (``to_train_config``), before anything is built.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf


class TrainerError(CompactHydraException):
    """A problem the user can fix; printed as one line, without a traceback."""


class ConfigError(TrainerError):
    pass


MAX_SEED = 2**32 - 1  # numpy's generator takes seeds in [0, 2**32)


class ModelName(Enum):
    cnn = "cnn"
    resnet18 = "resnet18"
    fastcnn = "fastcnn"  # a small residual net for fast CIFAR training (ResNet-9 family)


class DataSource(Enum):
    cifar10 = "cifar10"
    synthetic = "synthetic"
    imagefolder = "imagefolder"


class LoaderKind(Enum):
    torch = "torch"  # torch.utils.data.DataLoader, whole uint8 batches built in its workers
    gpu = "gpu"  # whole uint8 dataset resident on the device, batched augmentation there


class DecodeMode(Enum):
    auto = "auto"  # once, when the decoded images fit in a quarter of the free memory
    once = "once"  # decode every image file once, in parallel, and hold the uint8 array in memory
    every_epoch = "every_epoch"  # decode each file when its batch is built (folders too large for memory)


class OptimizerName(Enum):
    sgd = "sgd"
    adamw = "adamw"


class LrScaling(Enum):
    auto = "auto"  # linear for sgd, sqrt for adamw (timm's lr_base_scale convention)
    linear = "linear"  # lr x global batch / lr_base_batch
    sqrt = "sqrt"  # lr x sqrt(global batch / lr_base_batch)
    none = "none"  # lr as given, whatever the batch


class Schedule(Enum):
    onecycle = "onecycle"  # torch's OneCycleLR: cosine rise and fall, momentum cycled 0.95 -> 0.85 -> 0.95
    cosine = "cosine"
    constant = "constant"
    linear = "linear"  # a straight rise from lr_start_frac x the peak, then a straight fall to 0


class AmpDtype(Enum):
    auto = "auto"  # bf16 where supported (CPU, CUDA with bf16), else fp16
    bf16 = "bf16"
    fp16 = "fp16"


class CompileMode(Enum):
    default = "default"
    reduce_overhead = "reduce-overhead"  # CUDA graphs: least launch overhead, static shapes
    max_autotune = "max-autotune"  # autotuned kernels + CUDA graphs, minutes to compile
    max_autotune_no_cudagraphs = "max-autotune-no-cudagraphs"


class TtaMode(Enum):
    none = "none"
    flip = "flip"  # the image and its mirror
    flip_translate = "flip_translate"  # those two, each also shifted one pixel up-left and down-right


class ExportFormat(Enum):
    none = "none"
    torchscript = "torchscript"  # model.torchscript.pt, a traced module: torch.jit.load
    export = "export"  # model.pt2, a torch.export program: torch.export.load(...).module()


class DdpBackend(Enum):
    auto = "auto"  # nccl on CUDA, gloo on CPU
    nccl = "nccl"
    gloo = "gloo"


class DdpCommHook(Enum):
    none = "none"  # all-reduce the fp32 gradients as they are
    bf16 = "bf16"  # cast each gradient bucket to bf16 for the all-reduce (half the bytes)
    fp16 = "fp16"  # cast each gradient bucket to fp16 for the all-reduce (half the bytes)
    powersgd = "powersgd"  # rank-1 PowerSGD compression with error feedback, after 10 plain steps


@dataclass
class ModelConfig:
    name: ModelName = ModelName.resnet18  # picked by the `model=` group
    target: str | None = None  # your own model instead: 'module:callable', callable(num_classes) -> nn.Module
    conv_bias: bool = True  # false: no bias on convs followed by BatchNorm (it is redundant)
    grad_checkpointing: bool = False  # recompute residual stages in backward: memory for compute


@dataclass
class DataConfig:
    source: DataSource = DataSource.cifar10  # picked by the `data=` group
    root: str | None = (
        None  # cifar10: holds cifar-10-batches-py (download target); imagefolder: holds train/ and test/
    )
    download: bool = True  # cifar10: download into root when absent
    train_size: int = 5_000  # synthetic: training images
    test_size: int = 1_000  # synthetic: test images
    augment: bool = True  # random crop 32 of the zero-padded image + horizontal flip (training only)
    crop_padding: int = 4  # augment: pixels of padding on each side, so shifts of up to this many
    loader: LoaderKind = LoaderKind.torch  # torch DataLoader, or gpu-resident tensors
    decode: DecodeMode = DecodeMode.auto  # imagefolder: when image files are decoded
    decode_cache: bool = False  # imagefolder: keep decoded images in <root>/.trainer-cache for the next run
    prefetch: bool = False  # CUDA: copy the next batch on a side stream while this one computes
    cutout: int = 0  # training: blank a square this many pixels wide (mean colour) at a random place

    def __post_init__(self) -> None:
        if not 0 <= self.crop_padding <= 16:
            raise ConfigError(
                f"data.crop_padding must be 0 to 16 pixels, got {self.crop_padding}: "
                "set e.g. data.crop_padding=4"
            )
        if not 0 <= self.cutout <= 32:
            raise ConfigError(
                f"data.cutout must be 0 (off) to 32 pixels, got {self.cutout}: set e.g. data.cutout=12"
            )


@dataclass
class OptimConfig:
    name: OptimizerName = OptimizerName.sgd  # picked by the `optim=` group
    lr: float = 0.05  # peak learning rate for a global batch of lr_base_batch images
    lr_base_batch: int = 128  # the global batch (batch_size x processes x grad_accum_steps) lr is given for
    lr_scaling: LrScaling = LrScaling.auto  # how the peak lr follows the run's global batch
    momentum: float = 0.9  # sgd
    nesterov: bool = True  # sgd
    weight_decay: float = 5e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # adamw
    schedule: Schedule = Schedule.onecycle
    warmup_frac: float = 0.2  # onecycle, linear: fraction of the steps spent rising to lr
    lr_start_frac: float = 0.2  # linear: the first step's lr, as a fraction of the peak
    label_smoothing: float = 0.0
    # lr multiplier for BatchNorm shifts (biases); their weight decay is divided by it, so the
    # decay per step stays. Fast CIFAR nets with a fixed BatchNorm scale train them 64x faster.
    norm_bias_lr_scale: float = 1.0

    def __post_init__(self) -> None:
        # Checked here, not left to torch, so that a bad value costs one line before any run folder exists.
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise ConfigError(
                f"optim.lr must be finite and not negative, got {self.lr}: set e.g. optim.lr=0.05"
            )
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ConfigError(
                f"optim.weight_decay must be 0 or more, got {self.weight_decay}: "
                "set optim.weight_decay=0 (none) or e.g. optim.weight_decay=5e-4"
            )
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(
                f"optim.momentum must be in [0, 1), got {self.momentum}: "
                "set optim.momentum=0.9 (or optim.momentum=0 for none)"
            )
        if self.name is OptimizerName.sgd and self.nesterov and self.momentum == 0:
            raise ConfigError(
                "optim.nesterov=true needs momentum: set optim.momentum=0.9 or optim.nesterov=false"
            )
        if len(self.betas) != 2 or not all(0.0 <= beta < 1.0 for beta in self.betas):
            raise ConfigError(
                f"optim.betas must be two numbers in [0, 1), got {list(self.betas)}: "
                "set optim.betas=[0.9,0.999]"
            )
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"optim.label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if not 0.0 < self.warmup_frac < 1.0:
            raise ConfigError(f"optim.warmup_frac must be in (0, 1), got {self.warmup_frac}")
        if not 0.0 <= self.lr_start_frac <= 1.0:
            raise ConfigError(f"optim.lr_start_frac must be in [0, 1], got {self.lr_start_frac}")
        if not (math.isfinite(self.norm_bias_lr_scale) and self.norm_bias_lr_scale > 0):
            raise ConfigError(
                f"optim.norm_bias_lr_scale must be above 0, got {self.norm_bias_lr_scale}: "
                "set optim.norm_bias_lr_scale=1"
            )
        if self.lr_base_batch < 1:
            raise ConfigError(
                f"optim.lr_base_batch must be at least 1, got {self.lr_base_batch}: "
                "set optim.lr_base_batch=128"
            )


@dataclass
class EvalConfig:
    tta: TtaMode = TtaMode.none  # test-time augmentation: logits averaged over views -> test_acc_tta
    # the first epoch evaluated on the test set; then every eval_every epochs, and always the last
    # (a recipe that knows when its target can be reached evaluates no earlier)
    from_epoch: int = 1

    def __post_init__(self) -> None:
        if self.from_epoch < 1:
            raise ConfigError(
                f"eval.from_epoch must be at least 1, got {self.from_epoch}: set eval.from_epoch=1"
            )


@dataclass
class EmaConfig:
    # An exponential moving average of the weights and BatchNorm statistics, evaluated,
    # checkpointed and exported in place of the trained weights (trainer/ema.py says how).
    enabled: bool = False
    # per update once warmed up: average = decay x average + (1 - decay) x weights; update n
    # uses at most (1 + n) / (10 + n), so the initialization fades from the average at once
    decay: float = 0.99
    update_every: int = 1  # optimizer steps between updates

    def __post_init__(self) -> None:
        if not 0.0 <= self.decay < 1.0:
            raise ConfigError(f"ema.decay must be in [0, 1), got {self.decay}: set e.g. ema.decay=0.99")
        if self.update_every < 1:
            raise ConfigError(
                f"ema.update_every must be at least 1, got {self.update_every}: set ema.update_every=1"
            )


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)

    seed: int = 0  # one seed for python, numpy and torch: 0 to 2**32 - 1
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    epochs: int = 10
    max_steps: int | None = None  # stop after this many optimizer steps (null: run all epochs)
    batch_size: int = 128  # images per forward pass, per process
    eval_every: int = 1  # evaluate on the test set every N epochs (and after the last)
    resume: str | None = None  # a checkpoint file or a run folder to continue from
    deterministic: bool = False  # deterministic algorithms, no cudnn autotuning
    log_every: int = 50  # optimizer steps between loss logs, progress updates and NaN checks
    target_acc: float | None = None  # test accuracy (with TTA when on) whose first time is in metrics.json
    export: ExportFormat = ExportFormat.none  # the evaluated model, for inference, when the run completes

    # Optimization toggles. All off is a plain PyTorch loop (the `perf=baseline` preset); the
    # defaults feed the GPU (workers, pinned memory, non-blocking copies) and leave the rest off.
    amp: bool = False  # torch.autocast mixed precision
    amp_dtype: AmpDtype = AmpDtype.auto
    grad_accum_steps: int = 1  # micro-batches of batch_size per optimizer step
    set_to_none: bool = False  # zero_grad(set_to_none=True): drop grads instead of zeroing
    # DataLoader worker processes; auto: 4 per GPU, capped by the cores per process less one
    # (0 on a CPU device, where the training step uses every core)
    num_workers: Any = "auto"
    pin_memory: bool = True  # page-locked host batches (CUDA only)
    persistent_workers: bool = False  # keep workers alive between epochs (num_workers > 0)
    prefetch_factor: int | None = None  # batches each worker loads ahead (num_workers > 0)
    non_blocking: bool = True  # asynchronous host-to-device copies (CUDA only)
    channels_last: bool = False  # NHWC memory format for model and inputs
    cudnn_benchmark: bool = False  # let cuDNN time its algorithms for each input shape
    tf32: bool = False  # TensorFloat-32 matmuls and convolutions on Ampere+
    compile: bool = False  # torch.compile the model
    compile_mode: CompileMode = CompileMode.default
    fused_optimizer: bool = False  # one fused kernel for the optimizer step (CUDA)
    measure_data_wait: bool = True  # time data wait vs compute each epoch (CUDA events, no syncs)
    profile: bool = False  # torch.profiler over a few steps; trace saved in the run folder

    ddp: bool = False  # DistributedDataParallel over `devices` processes
    # GPUs for ddp (a process each) or data_parallel (null: every GPU); with ddp on CPU: processes
    devices: int | None = None
    ddp_backend: DdpBackend = DdpBackend.auto
    ddp_max_restarts: int = 0  # restart the ranks from the run's last checkpoint after one dies, N times
    ddp_comm_hook: DdpCommHook = DdpCommHook.none  # gradient compression for DDP's all-reduce
    # DDP gradient bucket size in MB, one all-reduce per bucket; auto: the whole gradient in one
    # bucket up to 128 MB, torch's 25 MB above (trainer/perf/ddp.py says why)
    ddp_bucket_cap_mb: Any = "auto"
    ddp_gradient_as_bucket_view: bool = False  # .grad are views into DDP's buckets: no copy, less memory
    ddp_static_graph: bool = False  # the same graph every step: DDP plans its buckets once
    # nn.DataParallel over `devices` GPUs in one process (null: all); batch_size is split between them
    data_parallel: bool = False

    def __post_init__(self) -> None:
        positive = ("epochs", "batch_size", "eval_every", "grad_accum_steps", "log_every")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"{name} must be at least 1, got {getattr(self, name)}: set {name}=1 or more"
                )
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"max_steps must be null or at least 1, got {self.max_steps}")
        workers = self.num_workers
        if workers != "auto" and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 0):
            raise ConfigError(
                f"num_workers must be auto or a whole number >= 0, got {self.num_workers!r}: "
                "set num_workers=auto or num_workers=4"
            )
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got '{self.device}'")
        if self.num_workers == 0 and (self.persistent_workers or self.prefetch_factor is not None):
            raise ConfigError(
                "persistent_workers and prefetch_factor need worker processes: set num_workers=2 "
                "(or more), or drop them"
            )
        if self.prefetch_factor is not None and self.prefetch_factor < 1:
            raise ConfigError(f"prefetch_factor must be null or at least 1, got {self.prefetch_factor}")
        if self.devices is not None and self.devices < 1:
            raise ConfigError(f"devices must be null or at least 1, got {self.devices}")
        if self.ddp_max_restarts < 0:
            raise ConfigError(f"ddp_max_restarts must be 0 or more, got {self.ddp_max_restarts}")
        bucket = self.ddp_bucket_cap_mb
        number = isinstance(bucket, (int, float)) and not isinstance(bucket, bool)
        if bucket != "auto" and not (number and math.isfinite(bucket) and bucket > 0):
            raise ConfigError(
                f"ddp_bucket_cap_mb must be auto or a size in MB above 0, got {bucket!r}: "
                "set ddp_bucket_cap_mb=auto or ddp_bucket_cap_mb=25"
            )
        if self.ddp and self.data_parallel:
            raise ConfigError(
                "ddp=true and data_parallel=true both spread the batch over the devices: "
                "set data_parallel=false (DDP, one process per device) or ddp=false"
            )
        if self.data.source is not DataSource.synthetic and not self.data.root:
            raise ConfigError(f"data={self.data.source.value} needs a folder: set data.root=/path/to/data")
        if self.data.loader is LoaderKind.gpu and self.num_workers not in (0, "auto"):
            raise ConfigError("data.loader=gpu uses no worker processes: set num_workers=0 (or auto)")
        if self.data.loader is LoaderKind.gpu and self.data.decode is DecodeMode.every_epoch:
            raise ConfigError(
                "data.loader=gpu holds the decoded images on the device: set data.decode=once (or auto)"
            )
        graph_modes = (CompileMode.reduce_overhead, CompileMode.max_autotune)
        if self.compile and self.compile_mode in graph_modes and not self.set_to_none:
            # The first backward hands the graph's own output buffers to .grad; zeroing them in
            # place keeps them, and the next replay overwrites them mid-step (a RuntimeError).
            raise ConfigError(
                f"compile_mode={self.compile_mode.name} replays CUDA graphs, whose gradient buffers "
                "must be dropped between steps, not zeroed: set set_to_none=true, or "
                "compile_mode=max_autotune_no_cudagraphs"
            )
        if self.data.source is DataSource.synthetic and min(self.data.train_size, self.data.test_size) < 1:
            raise ConfigError("data.train_size and data.test_size must be at least 1")
        if self.target_acc is not None and not 0.0 < self.target_acc <= 1.0:
            raise ConfigError(
                f"target_acc is a fraction in (0, 1], got {self.target_acc}: set e.g. target_acc=0.94"
            )
        if not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(
                f"seed must be in [0, {MAX_SEED}] (numpy's range), got {self.seed}: set seed=0 or another "
                "whole number in that range"
            )


def register_schema() -> None:
    """Register the schema with Hydra so that conf/ files are type-checked against it."""
    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainConfig)
    store.store(group="model", name="model_schema", node=ModelConfig)
    store.store(group="data", name="data_schema", node=DataConfig)
    store.store(group="optim", name="optim_schema", node=OptimConfig)


def to_train_config(cfg: DictConfig | dict | TrainConfig) -> TrainConfig:
    """Validate a composed config against the schema and return the typed object.

    Re-merging onto the schema rejects keys added with `+key=value`, which Hydra lets
    through; building the dataclasses runs the cross-field checks.
    """
    if isinstance(cfg, TrainConfig):
        return cfg
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True)
    cfg = {key: value for key, value in cfg.items() if key != "hydra"}
    try:
        merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), cfg)
        return OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except Exception as error:  # OmegaConf's messages span lines; keep the first
        raise ConfigError(describe_omegaconf_error(error)) from None


def describe_omegaconf_error(error: Exception) -> str:
    message = str(error).splitlines()[0]
    key = getattr(error, "full_key", None)
    match = re.search(r"Key '([^']+)' not in '(\w+)'", message)
    if match:
        return unknown_key_message(f"{key}" if key else match.group(1))
    if key:
        return f"invalid value for {key}: {message}"
    return message


def schema_keys() -> list[str]:
    """Every dotted key of the schema, e.g. 'amp', 'data.root'."""
    container = OmegaConf.to_container(OmegaConf.structured(TrainConfig))

    def walk(node: dict, prefix: str) -> list[str]:
        keys = []
        for name, value in node.items():
            keys.append(prefix + name)
            if isinstance(value, dict):
                keys.extend(walk(value, f"{prefix}{name}."))
        return keys

    return walk(container, "")


def unknown_key_message(key: str) -> str:
    import difflib

    close = difflib.get_close_matches(key, schema_keys(), n=1, cutoff=0.6)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return (
        f"unknown config key '{key}'.{hint} See `python -m trainer --cfg job` for every key and its default."
    )
