"""The values of the schema's choice fields: one Enum per field kind, a comment per member.

Hydra answers any other value with the allowed ones. A new choice is a member here and the
code that acts on it (trainer/perf/ for a toggle, else the module the field's comment names).
Owns: which values exist. Must not touch: defaults and field docs (trainer/config.py), checks
(trainer/config_checks.py), torch (imported before it, by the command-line check).
"""

from __future__ import annotations

from enum import Enum


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
    muon = "muon"  # torch.optim.Muon for the convolution weights, sgd for the rest


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


class FlipMode(Enum):
    random = "random"  # each image mirrored with probability 1/2, drawn anew every epoch
    alternating = "alternating"  # drawn for the first epoch, inverted every other epoch after


class PaddingMode(Enum):
    constant = "constant"  # zeros (black)
    reflect = "reflect"  # the image mirrored at its edge, the edge pixel not repeated (torch's reflect)


class TtaMode(Enum):
    none = "none"
    flip = "flip"  # the image and its mirror
    flip_translate = "flip_translate"  # those two, each also shifted one pixel up-left and down-right


class ExportFormat(Enum):
    none = "none"
    torchscript = "torchscript"  # model.torchscript.pt, a traced module: torch.jit.load
    export = "export"  # model.pt2, a torch.export program: torch.export.load(...).module()


class TbStep(Enum):
    images = "images"  # images trained on (steps x global batch): any batch or GPU count lines up
    step = "step"  # optimizer steps


class DdpBackend(Enum):
    auto = "auto"  # nccl on CUDA, gloo on CPU
    nccl = "nccl"
    gloo = "gloo"


class DdpSync(Enum):
    auto = "auto"  # after_backward, unless a setting only the wrapper reads asks for it (perf/ddp.py)
    after_backward = "after_backward"  # one all-reduce of the flat gradient after backward, no wrapper
    wrapper = "wrapper"  # torch's DistributedDataParallel: bucketed all-reduces during backward


class DdpCommHook(Enum):
    none = "none"  # all-reduce the fp32 gradients as they are
    bf16 = "bf16"  # cast each gradient bucket to bf16 for the all-reduce (half the bytes)
    fp16 = "fp16"  # cast each gradient bucket to fp16 for the all-reduce (half the bytes)
    powersgd = "powersgd"  # rank-1 PowerSGD compression with error feedback, after 10 plain steps
