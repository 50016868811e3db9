"""Whether starting CUDA in a thread, while the main thread imports what a run's set-up imports,
shortens the set-up: each variant in a fresh process, taking turns, seconds from `import torch`
done to both done (CUDA started, cuDNN and cuBLAS loaded by the trainer's own
`trainer.perf.cuda_start.start_cuda`: one small convolution forward and backward and one matmul,
bf16, channels_last; torchvision, torch._dynamo and inductor's compiler imported).

    python scripts/startup_overlap.py --repeats 3

  in turn     CUDA started after the imports, in the main thread (a run before perf.cuda_ahead)
  overlapped  CUDA started in a thread begun before the imports (a run with it)

Also printed per variant: CUDA's start as the thread or the main thread saw it, and (first ops
after) a convolution and a matmul of other shapes in the main thread afterwards: what a run's
first step would still pay for the libraries. A gain means CUDA's start let go of the GIL while
the imports ran. A development tool: it decides nothing and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

PROBE = r"""
import json, sys, threading, time
import torch
from trainer.perf.cuda_start import start_cuda
began = time.perf_counter()
cuda_s = []

def start():
    started = time.perf_counter()
    start_cuda(torch.device("cuda"), lambda: torch.bfloat16, torch.channels_last)
    cuda_s.append(time.perf_counter() - started)

thread = threading.Thread(target=start) if sys.argv[1] == "overlapped" else None
if thread:
    thread.start()
import torchvision  # noqa: F401  (it loads torch._dynamo, as a run's data set-up does)
import torch._dynamo  # noqa: F401
import torch._inductor.compile_fx  # noqa: F401  (torch.compile's first call imports it)
imported = time.perf_counter() - began
if thread:
    thread.join()
else:
    start()
total = time.perf_counter() - began
after = time.perf_counter()
bf16 = dict(device="cuda", dtype=torch.bfloat16)
images = torch.zeros(64, 32, 16, 16, **bf16).to(memory_format=torch.channels_last)
torch.nn.functional.conv2d(images, torch.zeros(32, 32, 3, 3, **bf16), padding=1)
torch.zeros(64, 64, **bf16) @ torch.zeros(64, 64, **bf16)
torch.cuda.synchronize()
after = time.perf_counter() - after
print(json.dumps({"total": total, "imports": imported, "cuda": cuda_s[0], "after": after}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    checkout = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(checkout))  # this checkout's trainer
    from trainer import bytecode

    bytecode.cache_bytecode()  # the probes take its prefix: their imports read bytecode, as a run's do
    import torch

    if not torch.cuda.is_available():
        sys.exit("startup_overlap: needs a CUDA GPU (it times CUDA's start)")
    variants = ("in turn", "overlapped")
    seen: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name in variants:
            argument = "overlapped" if name == "overlapped" else "serial"
            output = subprocess.run(
                [sys.executable, "-c", PROBE, argument],
                capture_output=True,
                text=True,
                check=True,
                cwd=checkout,
            ).stdout
            seen[name].append(json.loads(output.strip().splitlines()[-1]))
    print("| variant | runs | both done (median, s) | spread | imports | CUDA's start | first ops after |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, runs in seen.items():
        totals = [run["total"] for run in runs]
        print(
            f"| {name} | {len(runs)} | {statistics.median(totals):.2f} | {min(totals):.2f}-{max(totals):.2f} "
            f"| {statistics.median(run['imports'] for run in runs):.2f} "
            f"| {statistics.median(run['cuda'] for run in runs):.2f} "
            f"| {statistics.median(run['after'] for run in runs):.3f} |"
        )


if __name__ == "__main__":
    main()
