"""What one profiled training step costs, from a run's torch.profiler trace (profile=true).

    python scripts/trace_summary.py outputs/<run>/profile/*.pt.trace.json

Per profiled step (the trace's ProfilerStep#N spans): its host time, the kernel launches the
host made (cudaLaunchKernel and its kin) against the CUDA graph replays (cudaGraphLaunch), the
kernels that ran on the device and their summed time, and the NCCL kernels among them. A step
whose forward and backward replay as a CUDA graph shows a handful of launches; one that runs
eagerly shows hundreds, and its host time is then the step's floor.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from pathlib import Path

LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as file:
        return json.load(file)["traceEvents"]


def summarize(events: list[dict]) -> dict:
    """Per-step medians over the trace's ProfilerStep spans."""
    steps = sorted(
        (e for e in events if str(e.get("name", "")).startswith("ProfilerStep#") and "dur" in e),
        key=lambda e: e["ts"],
    )
    if not steps:
        raise SystemExit(
            "trace_summary: no ProfilerStep# spans in this trace (was it written by profile=true?)"
        )
    # the device runs behind the host: a kernel belongs to the step whose host call launched it
    kernels_of: dict[int, list[dict]] = {}
    for event in events:
        if event.get("cat") == "kernel" and "correlation" in event.get("args", {}):
            kernels_of.setdefault(event["args"]["correlation"], []).append(event)
    per_step = []
    for step in steps:
        start, end = step["ts"], step["ts"] + step["dur"]
        inside = [
            e for e in events if "dur" in e and start <= e.get("ts", -1) < end and e.get("cat") != "kernel"
        ]
        calls = {e["args"]["correlation"] for e in inside if "correlation" in e.get("args", {})}
        kernels = [kernel for call in calls for kernel in kernels_of.get(call, [])]
        per_step.append(
            {
                "host_ms": step["dur"] / 1e3,
                "kernel_launches": sum(e["name"] in LAUNCHES for e in inside),
                "graph_launches": sum(e["name"] in GRAPH_LAUNCHES for e in inside),
                "kernels_run": len(kernels),
                "kernel_ms": sum(e["dur"] for e in kernels) / 1e3,
                "nccl_kernels": sum("nccl" in e["name"].lower() for e in kernels),
            }
        )
    return {key: statistics.median(step[key] for step in per_step) for key in per_step[0]} | {
        "steps": len(per_step)
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("traces", nargs="+", type=Path)
    args = parser.parse_args(argv)
    print(
        "| trace | steps | host ms/step | kernel launches | graph launches | kernels run | kernel ms | NCCL |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for path in args.traces:
        s = summarize(load(path))
        print(
            f"| {path.name} | {s['steps']} | {s['host_ms']:.2f} | {s['kernel_launches']:.0f} | "
            f"{s['graph_launches']:.0f} | {s['kernels_run']:.0f} | {s['kernel_ms']:.2f} | "
            f"{s['nccl_kernels']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
