"""`python -m trainer.serve`: a warm process for this environment's `python -m trainer` commands.

    python -m trainer.serve &             # serve until stopped, or idle for --idle-minutes
    python -m trainer ...                 # now forked from it: starts without the imports
    python -m trainer.serve --status      # whether one serves this environment
    python -m trainer.serve --stop        # it takes no new command, ends after its runs

Owns: the command line. Must not touch: the hand-over (client.py), the loop (server.py).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

from trainer.serve import protocol


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.serve",
        description=(
            "Keep a process with Hydra, torch and the trainer imported: while it runs, "
            "`python -m trainer ...` from the same environment (Python, code, import-time "
            "variables) runs forked from it instead of importing them again. "
            "TRAINER_SERVE=0 runs one command by itself."
        ),
    )
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--stop", action="store_true", help="stop this environment's server after its runs")
    action.add_argument("--status", action="store_true", help="say whether a server serves this environment")
    parser.add_argument(
        "--idle-minutes",
        type=float,
        default=60.0,
        help="stop after this long without a command; 0: never (default 60)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    environ = dict(os.environ)  # as started: the key is the environment's before anything here changes it
    path = protocol.socket_path(protocol.environment_key(environ))
    from trainer.serve import server

    if args.stop or args.status:
        answer = server.ask(path, {"stop": True} if args.stop else {"status": True})
        if answer is None:
            print(f"trainer.serve: no server for this environment ({path})")
            return 1 if args.stop else 0
        verb = "stopping" if args.stop else "serving"
        counts = f"{answer['running']} running, {answer['served']} served"
        print(f"trainer.serve: pid {answer['pid']} {verb}: {counts}")
        return 0
    if not hasattr(socket, "SO_PEERCRED"):
        print("trainer.serve: error: needs Linux (a socket's peer credentials, SO_PEERCRED)", file=sys.stderr)
        return 2
    try:
        protocol.private_folder()
    except PermissionError as error:
        print(f"trainer.serve: error: {error}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    from trainer import bytecode

    bytecode.cache_bytecode()
    server.preload()
    try:
        loop = server.Server(path, args.idle_minutes * 60 if args.idle_minutes > 0 else None, environ)
    except FileExistsError as error:
        print(f"trainer.serve: error: {error}: python -m trainer.serve --stop", file=sys.stderr)
        return 1
    print(
        f"trainer.serve: ready in {time.perf_counter() - started:.1f} s (pid {os.getpid()}): "
        "`python -m trainer ...` from this environment now runs forked from here; "
        "stop: python -m trainer.serve --stop",
        flush=True,
    )
    loop.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
