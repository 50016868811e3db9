"""How a command's process ends: its exit code as the interpreter would give it, what the
interpreter does at exit that anything depends on (threading's exit hooks, the threads that
are not daemons joined, every atexit handler: logging's flush, multiprocessing's stop of its
children, inductor's compile workers), then os._exit, without the teardown of the
interpreter itself.

Why by hand: after main returns, CPython frees every module and object one by one, and with
torch loaded that is most of what is left of the process: on a 2-core CPU (torch 2.14.1) a
smoke run exited 0.78-0.81 s after writing metrics.json, with nothing left to write
(README, "From Enter to result"). Nothing here kills what the run started: what atexit stops
is stopped as at a normal exit.

    if __name__ == "__main__":
        process_exit.run(main)

Only for a process's own entry point: a caller of main() in Python (a test) keeps running.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import NoReturn


def run(main: Callable[[], object]) -> NoReturn:
    code = exit_code_of(main)
    # As the interpreter's own exit: threading's exit hooks (concurrent.futures tells its
    # workers' manager threads to stop there), the threads that are not daemons joined, then
    # the atexit handlers.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        # a closed or full stdout (a pipe into `head`) must not change the exit code
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def exit_code_of(main: Callable[[], object]) -> int:
    """main()'s exit code as `sys.exit(main())` makes it: the int main returns, SystemExit's
    code (a message goes to stderr, and gives 1), 130 after Ctrl-C, or 1 after an uncaught
    exception, whose traceback goes to stderr."""
    try:
        returned = main()
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        return 130
    except BaseException:
        traceback.print_exc()
        return 1
    return returned if isinstance(returned, int) else 0
