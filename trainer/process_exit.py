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
Under a debugger or profiler (`python -m cProfile -m trainer`; `watched`), or with TRAINER_FULL_EXIT set,
the process ends through the interpreter's own exit instead.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import NoReturn

KEEP_TEARDOWN = "TRAINER_FULL_EXIT"  # set (to anything): end through the interpreter's own exit


def run(main: Callable[[], object]) -> NoReturn:
    if watched() or os.environ.get(KEEP_TEARDOWN):
        sys.exit(main())  # under a debugger or profiler, which act at the interpreter's exit
    ctrl_c = []  # an uncaught Ctrl-C, not a run that stopped on one and exits 130 itself

    def noting_ctrl_c() -> object:
        try:
            return main()
        except KeyboardInterrupt:
            ctrl_c.append(True)
            raise

    code = exit_code_of(noting_ctrl_c)
    # As the interpreter's own exit: threading's exit hooks (concurrent.futures tells its
    # workers' manager threads to stop there), the threads that are not daemons joined, then
    # the atexit handlers.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        # None where the descriptor was closed at start; a closed or full stdout (a pipe into
        # `head`) must not change the exit code
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):  # what C libraries buffered (NCCL_DEBUG, CUDA printf)
        ctypes.CDLL(None).fflush(None)
    if ctrl_c:
        # as the interpreter ends after an uncaught Ctrl-C: by SIGINT, so that a shell loop stops
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def watched() -> bool:
    """Whether a debugger or profiler watches this process: through sys.settrace or
    sys.setprofile, or through sys.monitoring (Python 3.12 on), where cProfile registers from
    3.12 and sys.getprofile() stays None: os._exit then ended `python -m cProfile -o ...` before
    it wrote its file."""
    if sys.gettrace() is not None or sys.getprofile() is not None:
        return True
    monitoring = getattr(sys, "monitoring", None)
    if monitoring is None:
        return False
    tools = (monitoring.DEBUGGER_ID, monitoring.PROFILER_ID)
    return any(monitoring.get_tool(tool) is not None for tool in tools)


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
