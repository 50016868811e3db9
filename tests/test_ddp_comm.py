"""DDP's communication toggles act, seen in the gradients DDP hands back (two gloo ranks, one launch),
and data_parallel's refusals and CPU line."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import compose_config
from torch import nn

from trainer import Trainer
from trainer.config import ConfigError, to_train_config
from trainer.models import build_model
from trainer.perf import bucket_cap_mb

# ddp_sync=wrapper: the variant without a toggle is DistributedDataParallel too
DDP = [
    "ddp=true",
    "ddp_sync=wrapper",
    "devices=2",
    "deterministic=true",
    "data.train_size=64",
    "batch_size=8",
]
VARIANTS = {
    "none": [],
    "fp16": ["ddp_comm_hook=fp16"],
    "bf16": ["ddp_comm_hook=bf16"],
    "powersgd": ["ddp_comm_hook=powersgd"],
    "bucket_25mb": ["ddp_bucket_cap_mb=25"],
    "bucket_half_mb": ["ddp_bucket_cap_mb=0.5"],
    "bucket_view": ["ddp_gradient_as_bucket_view=true"],
    "static_graph": ["ddp_static_graph=true"],
}
BACKWARD_PASSES = 12  # past PowerSGD's 10 uncompressed steps; DDP rebuilds its buckets after the first


def gradients_under_each_variant(ranks, configs: dict, run_dir: str) -> dict:
    """In a launched rank: each variant's DDP model, BACKWARD_PASSES backward passes on this
    rank's first batch, then what DDP left in .grad and how it got there."""
    from trainer import distributed

    distributed.init_process_group("gloo", ranks, torch.device("cpu"))
    try:
        seen = {}
        for name, config in configs.items():
            trainer = Trainer(config, f"{run_dir}/{name}", ranks=ranks).build(ranks)
            all_reduces = []
            if name.startswith("bucket_") and name != "bucket_view":
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                def counting_hook(state, bucket, calls=all_reduces):
                    calls.append(1)
                    return default_hooks.allreduce_hook(state, bucket)

                trainer.ddp_model.register_comm_hook(None, counting_hook)
            images, labels = next(iter(trainer.train_batches))
            for _ in range(BACKWARD_PASSES):
                all_reduces.clear()
                trainer.optimizer.zero_grad(set_to_none=False)
                trainer._forward_backward(images, labels, 1)
            parameters = dict(trainer.raw_model.named_parameters())
            seen[name] = {
                "grads": {key: p.grad.detach().clone() for key, p in parameters.items()},
                "all_reduces": len(all_reduces),
                "grad_storages": len({p.grad.untyped_storage().data_ptr() for p in parameters.values()}),
                "static_graph": trainer.ddp_model.static_graph,
                "bucket_bytes_cap": trainer.ddp_model.bucket_bytes_cap,
            }
        return seen
    finally:
        distributed.destroy_process_group()


@pytest.fixture(scope="module")
def effects(tmp_path_factory) -> dict:
    from trainer.distributed import launch

    run_dir = tmp_path_factory.mktemp("comm")
    configs = {
        name: Trainer(compose_config(*DDP, *extra), run_dir).config for name, extra in VARIANTS.items()
    }
    return launch(2, gradients_under_each_variant, (configs, str(run_dir)))


def representable(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    return torch.equal(tensor, tensor.to(dtype).float())


def test_compression_hooks_send_gradients_in_their_dtype(effects):
    """fp16/bf16: every averaged gradient went through the all-reduce in that dtype (each value
    is exactly representable in it, which plain fp32 gradients are not) and stays within a few
    of its roundings of the exact average (measured against each tensor's largest entry: where the
    ranks' gradients cancel, the relative error of the sum is unbounded)."""
    exact = effects["none"]["grads"]
    assert not all(representable(g, torch.float16) for g in exact.values())
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        for key, grad in effects[name]["grads"].items():
            assert representable(grad, dtype), (name, key)
            scale = exact[key].abs().max().item()
            error = (grad - exact[key]).abs().max().item()
            assert 0 < error <= 3 * torch.finfo(dtype).eps * scale, (name, key, error, scale)


def test_powersgd_sends_a_rank_one_approximation(effects):
    """After its uncompressed warm-up, PowerSGD all-reduces two rank-1 factors per matrix: each
    conv kernel's gradient, as an (out, in x 3 x 3) matrix, has rank 1."""
    for key, grad in effects["powersgd"]["grads"].items():
        if grad.dim() == 4:
            assert torch.linalg.matrix_rank(grad.flatten(1)) == 1, key
            assert torch.linalg.matrix_rank(effects["none"]["grads"][key].flatten(1)) > 1, key


def test_bucket_size_bucket_views_and_static_graph_reach_ddp(effects):
    # the cnn's 4.2 MB of gradients: one all-reduce in a 25 MB bucket; in 0.5 MB ones its 4 MB
    # linear layer is one bucket and the rest another
    assert effects["bucket_25mb"]["all_reduces"] == 1
    assert effects["bucket_half_mb"]["all_reduces"] >= 2
    # ddp_bucket_cap_mb=auto (the default): the cnn's whole gradient, rounded up, plus 1 MB
    assert effects["none"]["bucket_bytes_cap"] == 6 * 2**20
    assert effects["bucket_25mb"]["bucket_bytes_cap"] == 25 * 2**20
    # as bucket views, the gradients live in DDP's few flat buckets instead of one tensor each
    assert effects["bucket_view"]["grad_storages"] < effects["none"]["grad_storages"]
    assert (effects["static_graph"]["static_graph"], effects["none"]["static_graph"]) == (True, False)
    for key, grad in effects["none"]["grads"].items():  # none of these changes the arithmetic
        for name in ("bucket_half_mb", "bucket_view", "static_graph"):
            torch.testing.assert_close(effects[name]["grads"][key], grad, rtol=1e-5, atol=1e-7)


def test_data_parallel_is_one_line_on_cpu_and_exclusive_with_ddp(tmp_path, caplog):
    with pytest.raises(ConfigError, match="ddp=true and data_parallel=true .* set data_parallel=false"):
        Trainer(compose_config("ddp=true", "devices=2", "data_parallel=true"), tmp_path / "a")
    with caplog.at_level(logging.INFO, logger="trainer.perf"):
        trainer = Trainer(compose_config("data_parallel=true", "devices=2"), tmp_path / "b").build()
    assert trainer.model.model is trainer.raw_model  # the step's forward calls it unwrapped
    assert "data_parallel=true has no effect here (it splits each batch over CUDA devices" in caplog.text


def test_auto_buckets_hold_a_small_gradient_whole_and_leave_a_large_one_to_torch():
    cfg = to_train_config(compose_config("model=resnet18"))
    with torch.device("meta"):
        resnet18 = build_model(cfg.model, num_classes=10)  # 44.7 MB (42.6 MiB) of fp32 gradients
        large = nn.Linear(8192, 8192)  # 256 MB
    assert bucket_cap_mb(cfg, resnet18) == 44  # MiB, as DDP counts them
    assert bucket_cap_mb(cfg, large) == 25
    assert bucket_cap_mb(to_train_config(compose_config("ddp_bucket_cap_mb=100")), large) == 100
    # perf=fast sets none of the wrapper's toggles, so that ddp_sync=auto averages after backward
    assert not to_train_config(compose_config("perf=fast", small=False)).ddp_gradient_as_bucket_view
    with pytest.raises(ConfigError, match="ddp_bucket_cap_mb must be auto or a size in MB above 0"):
        to_train_config(compose_config("ddp_bucket_cap_mb=0"))


def test_one_bucket_compiles_as_one_graph_and_smaller_buckets_keep_dynamos_split(monkeypatch):
    import torch._dynamo

    from trainer.perf.ddp import one_compiled_graph

    monkeypatch.setattr(torch._dynamo.config, "optimize_ddp", True)  # torch's default, put back after
    with torch.device("meta"):
        resnet18 = build_model(to_train_config(compose_config("model=resnet18")).model, num_classes=10)
    for overrides in (["compile=false"], ["compile=true", "ddp_bucket_cap_mb=25"]):
        cfg = to_train_config(compose_config("model=resnet18", *overrides))
        one_compiled_graph(cfg, resnet18, bucket_cap_mb(cfg, resnet18))
        assert torch._dynamo.config.optimize_ddp is True, overrides

    cfg = to_train_config(compose_config("model=resnet18", "compile=true"))
    one_compiled_graph(cfg, resnet18, bucket_cap_mb(cfg, resnet18))
    assert torch._dynamo.config.optimize_ddp is False
