"""The one typed schema. Every field is documented here and only here.

YAML files under conf/ hold presets that differ from these defaults. Each dataclass's
``__post_init__`` runs its checks (trainer/config_checks.py) when a composed config is
turned into these dataclasses (``to_train_config``), before anything is built.

Owns: every field, its type, default and meaning; turning a composed config into a
TrainConfig, and the wording of an unknown key ("Did you mean"). A new field is a line
here with its comment; a toggle's field is then read in trainer/perf/, nowhere else.
Beside it, importable from here too: the choices of each Enum field (trainer/config_choices.py),
the checks (trainer/config_checks.py), the errors (trainer/errors.py).
Must not touch: torch (the command-line check imports this before torch is loaded).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from trainer import config_checks
from trainer.config_choices import (
    AmpDtype,
    CompileMode,
    DataSource,
    DdpBackend,
    DdpCommHook,
    DdpSync,
    DecodeMode,
    ExportFormat,
    FlipMode,
    LoaderKind,
    LrScaling,
    ModelName,
    OptimizerName,
    PaddingMode,
    Schedule,
    TbStep,
    TtaMode,
)
from trainer.errors import ConfigError, TrainerError  # noqa: F401 - imported from here across the package
from trainer.job_names import job_dir_name, run_dir_name
from trainer.parallel_jobs import default_jobs


@dataclass
class ModelConfig:
    name: ModelName = ModelName.resnet18  # picked by the `model=` group
    target: str | None = None  # your own model instead: 'module:callable', callable(num_classes) -> nn.Module
    conv_bias: bool = True  # false: no bias on convs followed by BatchNorm (it is redundant)
    grad_checkpointing: bool = False  # recompute residual stages in backward: memory for compute
    zero_init_residual: bool = False  # resnet18: each block's last BatchNorm scale starts at 0 (an identity)
    # optim=sgd's lr for this model where the command line and recipe give none (conf/optim/sgd.yaml)
    sgd_lr: float = 0.1


@dataclass
class DataConfig:
    source: DataSource = DataSource.cifar10  # picked by the `data=` group
    root: str | None = (
        None  # cifar10: holds cifar-10-batches-py (download target); imagefolder: holds train/ and test/
    )
    download: bool = True  # cifar10: download into root when absent
    train_size: int = 5_000  # synthetic: training images
    test_size: int = 1_000  # synthetic: test images
    augment: bool = True  # random crop 32 of the padded image + horizontal flip (training only)
    crop_padding: int = 4  # augment: padding on each side, so shifts of up to this many pixels
    padding_mode: PaddingMode = PaddingMode.constant  # augment: what fills it, zeros or the mirrored image
    flip: FlipMode = FlipMode.random  # augment: how the horizontal flip is drawn
    loader: LoaderKind = LoaderKind.torch  # torch DataLoader, or gpu-resident tensors
    decode: DecodeMode = DecodeMode.auto  # imagefolder: when image files are decoded
    decode_cache: bool = False  # imagefolder: keep decoded images in <root>/.trainer-cache for the next run
    prefetch: bool = False  # CUDA: copy the next batch on a side stream while this one computes
    cutout: int = 0  # training: blank a square this many pixels wide (mean colour) at a random place
    # progressive resizing: the first low_res_epochs epochs train on images downscaled (on the
    # device, after augmentation) to low_res x low_res pixels; evaluation stays at full size
    low_res: int = 0  # 0: off; 8 to 31 pixels
    low_res_epochs: int = 0

    def __post_init__(self) -> None:
        config_checks.check_data(self)


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
    # muon: the convolution weights' peak lr (not scaled with the batch), momentum (Nesterov)
    # and decoupled weight decay; the other parameters train with sgd's settings above
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.0
    muon_ns_steps: int = 5  # muon: Newton-Schulz iterations that orthogonalize each update (torch's 5)
    # muon: before each step every convolution weight is rescaled to a Frobenius norm of
    # sqrt(its output channels); behind BatchNorm this changes no output, and keeps each step's
    # size relative to the weight the same through the run (the weights' norms otherwise grow)
    muon_fixed_norm: bool = False
    schedule: Schedule = Schedule.onecycle
    warmup_frac: float = 0.2  # onecycle, linear: fraction of the steps spent rising to lr
    lr_start_frac: float = 0.2  # linear: the first step's lr, as a fraction of the peak
    label_smoothing: float = 0.0
    # lr multiplier for BatchNorm shifts (biases); their weight decay is divided by it, so the
    # decay per step stays. Fast CIFAR nets with a fixed BatchNorm scale train them 64x faster.
    norm_bias_lr_scale: float = 1.0
    # the model's early parameters (its early_parameters(); fastcnn: the whitening conv's bias)
    # train only for the first N epochs, at the BatchNorm shifts' lr falling in a straight line
    # to 0 by the end of epoch N; 0: they train all run, as the rest. Schedules linear, constant
    early_epochs: int = 0

    def __post_init__(self) -> None:
        config_checks.check_optim(self)


@dataclass
class EvalConfig:
    tta: TtaMode = TtaMode.none  # test-time augmentation: logits averaged over views -> test_acc_tta
    # the first epoch evaluated on the test set; then every eval_every epochs, and always the last
    # (a recipe that knows when its target can be reached evaluates no earlier)
    from_epoch: int = 1
    # with tta: the share of each test batch that gets the views, the images whose plain
    # prediction is least sure (smallest gap between the two likeliest classes); 1: every image
    tta_unsure: float = 1.0

    def __post_init__(self) -> None:
        config_checks.check_eval(self)


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
        config_checks.check_ema(self)


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
    tb_step: TbStep = TbStep.images  # TensorBoard's x axis
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
    # torch.compile optim=muon's arithmetic (true), or run it eagerly (false); auto: compiled
    # with compile=true where no CUDA graph replays it (one launch per kernel is what compiling
    # saves, and a graph's replay saves it too), eager under step_graph or a graph compile_mode
    compile_optimizer: Any = "auto"
    # forward, backward and the gradient average over ranks captured once as one CUDA graph and
    # replayed each step (CUDA, grad_accum_steps=1); compile's own CUDA graphs then stay off
    step_graph: bool = False
    measure_data_wait: bool = True  # time data wait vs compute each epoch (CUDA events, no syncs)
    profile: bool = False  # torch.profiler over a few steps; trace saved in the run folder

    ddp: bool = False  # DistributedDataParallel over `devices` processes
    # GPUs for ddp (a process each) or data_parallel (null: every GPU); with ddp on CPU: processes
    devices: int | None = None
    ddp_backend: DdpBackend = DdpBackend.auto
    ddp_max_restarts: int = 0  # restart the ranks from the run's last checkpoint after one dies, N times
    # How the ranks average gradients: after_backward (one all-reduce of the flat gradient after
    # backward; the model compiles and CUDA-graphs as on one GPU), wrapper (torch's
    # DistributedDataParallel, which the four toggles below configure), auto (after_backward
    # unless one of those four is set, or the gradient is too large for one bucket)
    ddp_sync: DdpSync = DdpSync.auto
    ddp_comm_hook: DdpCommHook = DdpCommHook.none  # gradient compression for DDP's all-reduce
    # DDP gradient bucket size in MB, one all-reduce per bucket; auto: the whole gradient in one
    # bucket up to 128 MB, torch's 25 MB above (trainer/perf/ddp.py says why)
    ddp_bucket_cap_mb: Any = "auto"
    ddp_gradient_as_bucket_view: bool = False  # .grad are views into DDP's buckets: no copy, less memory
    ddp_static_graph: bool = False  # the same graph every step: DDP plans its buckets once
    # optim=muon under ddp: each rank orthogonalizes its share of the convolution weights and one
    # all-reduce gives every rank every update (false: each rank orthogonalizes every weight)
    ddp_shard_muon: bool = True
    # nn.DataParallel over `devices` GPUs in one process (null: all); batch_size is split between them
    data_parallel: bool = False

    def __post_init__(self) -> None:
        config_checks.check_train(self)


def register_schema() -> None:
    """Register the schema with Hydra so that conf/ files are type-checked against it, and the
    resolver that names sweep job folders (conf/config.yaml)."""
    OmegaConf.register_new_resolver("trainer_job_dir", job_dir_name, replace=True)
    OmegaConf.register_new_resolver("trainer_run_dir", run_dir_name, replace=True)
    OmegaConf.register_new_resolver("trainer_parallel_jobs", default_jobs, replace=True)
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

    if key.startswith("hydra."):  # Hydra's own keys: its config lists them
        return f"unknown config key '{key}'. See `python -m trainer --cfg hydra` for Hydra's keys and values."
    close = difflib.get_close_matches(key, schema_keys(), n=1, cutoff=0.6)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return (
        f"unknown config key '{key}'.{hint} See `python -m trainer --cfg job` for every key and its default."
    )
