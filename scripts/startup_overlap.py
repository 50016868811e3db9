"""Whether starting CUDA in a thread, while the main thread imports what a run's set-up imports,
shortens the set-up: each variant in a fresh process, taking turns, seconds from `import torch`
done to both done (CUDA started and a tensor on the GPU; torchvision and torch._dynamo imported).

    python scripts/startup_overlap.py --repeats 3

  in turn     CUDA started after the imports, in the main thread (what a run does today)
  overlapped  CUDA started in a thread begun before the imports

Also printed per variant: CUDA's own start (torch.cuda.init and the first tensor) as the thread
or the main thread saw it. A gain means CUDA's start let go of the GIL while the imports ran.
A development tool: it decides nothing and writes nothing.
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
began = time.perf_counter()
cuda_s = []

def start_cuda():
    started = time.perf_counter()
    torch.cuda.init()
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    cuda_s.append(time.perf_counter() - started)

thread = threading.Thread(target=start_cuda) if sys.argv[1] == "overlapped" else None
if thread:
    thread.start()
import torchvision  # noqa: F401  (it loads torch._dynamo, as a run's data set-up does)
import torch._dynamo  # noqa: F401
imported = time.perf_counter() - began
if thread:
    thread.join()
else:
    start_cuda()
print(json.dumps({"total": time.perf_counter() - began, "imports": imported, "cuda": cuda_s[0]}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's trainer
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
                [sys.executable, "-c", PROBE, argument], capture_output=True, text=True, check=True
            ).stdout
            seen[name].append(json.loads(output.strip().splitlines()[-1]))
    print("| variant | runs | both done (median, s) | spread | imports | CUDA's start |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, runs in seen.items():
        totals = [run["total"] for run in runs]
        print(
            f"| {name} | {len(runs)} | {statistics.median(totals):.2f} | {min(totals):.2f}-{max(totals):.2f} "
            f"| {statistics.median(run['imports'] for run in runs):.2f} "
            f"| {statistics.median(run['cuda'] for run in runs):.2f} |"
        )


if __name__ == "__main__":
    main()
