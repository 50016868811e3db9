"""How a trainer command ends: `python -m trainer ARGS` run in this process, with the end timed
part by part: threading's exit hooks, each atexit handler (by module and name), all of them.
Printed to stderr as EXIT lines with the moment each ended (time.time()), to set beside the
run folders' metrics.json times.

    python scripts/exit_phases.py -m model=fastcnn perf=fast seed=1,2 2>&1 | grep EXIT

A development tool: the command runs as it would, only its end is timed.
"""

from __future__ import annotations

import atexit
import runpy
import sys
import threading
import time


def timed(label, function):
    def wrapper(*args, **kwargs):
        started = time.time()
        try:
            return function(*args, **kwargs)
        finally:
            ended = time.time()
            line = f"EXIT {label}: {ended - started:.3f} s (ended at {ended:.3f})"
            print(line, file=sys.stderr, flush=True)

    return wrapper


def main() -> None:
    threading._shutdown = timed("threading._shutdown", threading._shutdown)
    atexit._run_exitfuncs = timed("atexit._run_exitfuncs", atexit._run_exitfuncs)
    register = atexit.register

    def register_timed(function, *args, **kwargs):
        label = f"atexit {getattr(function, '__module__', '')}.{getattr(function, '__qualname__', function)}"
        return register(timed(label, function), *args, **kwargs)

    atexit.register = register_timed  # handlers registered from here on: torch's, logging's, ...
    sys.argv = ["trainer", *sys.argv[1:]]
    runpy.run_module("trainer", run_name="__main__")


if __name__ == "__main__":
    main()
