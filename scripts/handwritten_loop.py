"""A minimal hand-written training loop with `perf=fast`'s settings, for scripts/bench.py.

No config, no logging, no checks: the yardstick for the framework's own overhead. Same data
(CIFAR-shaped synthetic, 50,000 images), same model, same optimizer and schedule as the
trainer; GPU-resident uint8 data with per-image random crop + flip done on the device,
bf16 autocast, channels_last, torch.compile, fused SGD, zero_grad(set_to_none=True),
no conv bias before BatchNorm.

    python scripts/handwritten_loop.py --model resnet18 --epochs 4 --out /tmp/hand
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from trainer.config import ModelConfig, ModelName
from trainer.data import CIFAR10_MEAN, CIFAR10_STD, SyntheticImages
from trainer.models import build_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--compile-mode", default="reduce-overhead")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    device = torch.device("cuda")
    data = SyntheticImages(50_000, train=True, seed=0)
    images = F.pad(data.images.to(device), (4, 4, 4, 4))
    labels = data.labels.to(device)
    mean = torch.tensor(CIFAR10_MEAN, device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor(CIFAR10_STD, device=device).view(1, 3, 1, 1) * 255

    model = build_model(ModelConfig(name=ModelName(args.model), conv_bias=False), 10).to(
        device, memory_format=torch.channels_last
    )
    step_model = torch.compile(model, mode=args.compile_mode)
    steps_per_epoch = len(labels) // args.batch_size
    optimizer = torch.optim.SGD(
        model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4, fused=True
    )
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, 0.05, total_steps=args.epochs * steps_per_epoch, pct_start=0.2
    )
    arange = torch.arange(32, device=device)

    history = []
    for epoch in range(args.epochs):
        torch.cuda.synchronize()
        started = time.perf_counter()
        order = torch.randperm(len(labels), device=device)
        for step in range(steps_per_epoch):
            index = order[step * args.batch_size : (step + 1) * args.batch_size]
            top = torch.randint(0, 9, (len(index), 1), device=device)
            left = torch.randint(0, 9, (len(index), 1), device=device)
            flip = torch.rand(len(index), 1, device=device) < 0.5
            rows = (top + arange)[:, None, :, None]
            cols = (left + torch.where(flip, arange.flip(0), arange))[:, None, None, :]
            batch = images[
                index[:, None, None, None], torch.arange(3, device=device)[None, :, None, None], rows, cols
            ]
            batch = ((batch.float() - mean) / std).contiguous(memory_format=torch.channels_last)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(step_model(batch), labels[index])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        history.append(
            {
                "epoch": epoch + 1,
                "epoch_s": seconds,
                "img_per_s": steps_per_epoch * args.batch_size / seconds,
                "data_wait_frac": None,
            }
        )
        print(f"epoch {epoch + 1}: {history[-1]['img_per_s']:,.0f} img/s, loss {loss.item():.3f}", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "metrics.json").write_text(
        json.dumps(
            {
                "status": "completed",
                "history": history,
                "test_acc": None,
                "peak_mem_mb": torch.cuda.max_memory_allocated() / 2**20,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
