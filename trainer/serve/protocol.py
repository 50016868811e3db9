"""Where a server listens and which commands it may take, in the standard library only: the
client reads this before it imports anything else.

A server serves one environment: the Python, the trainer's code, torch and Hydra as installed,
and the variables modules read when they are imported (torch, inductor, triton, CUDA's
libraries, OpenMP, Python's own). Those are what a process forked from it keeps from the
server instead of taking from the command. A command from another environment does not find
its socket and runs by itself, as without a server. The code is the trainer package's
modules by path, size and modification time: an edit makes the server stale for new commands.
The variables a run reads later (CUDA_VISIBLE_DEVICES at CUDA's start, the run's own) travel
with each command.

Owns: the socket's folder and name, the environment's key, the messages' framing. Must not
touch: what runs (server.py, child.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import socket
import stat
import struct
import sys
import tempfile
from pathlib import Path

FOLDER_VARIABLE = "TRAINER_SERVE_DIR"  # where servers listen (default: a folder per user)
SWITCH_VARIABLE = "TRAINER_SERVE"  # 0: this command runs by itself even where a server runs
# Read by modules when they are imported, so a forked run keeps the server's.
IMPORT_TIME_PREFIXES = (
    *("PYTHON", "LD_", "TORCH", "PYTORCH", "TRITON"),
    *("CUDA", "CUBLAS", "CUDNN", "NVIDIA", "OMP_", "MKL_", "KMP_", "OPENBLAS_"),
)
# Read after the imports (CUDA's start, the run), so each command brings its own.
READ_LATER = {"CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", SWITCH_VARIABLE, FOLDER_VARIABLE}
LENGTH = struct.Struct("!I")


def folder() -> Path:
    """The user's folder of sockets: $TRAINER_SERVE_DIR, else trainer-serve-<uid> under
    $XDG_RUNTIME_DIR or the temporary folder; only its owner may enter it."""
    chosen = os.environ.get(FOLDER_VARIABLE)
    if chosen:
        return Path(chosen)
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"trainer-serve-{os.getuid()}"


def owned_folder(path: Path) -> bool:
    """Whether `path` is a folder of this user's that no one else may enter (not a link to one)."""
    try:
        status = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(status.st_mode) and status.st_uid == os.getuid() and not status.st_mode & 0o077


def private_folder() -> Path:
    """folder(), made if missing; refused where another user owns it or others may enter it."""
    path = folder()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not owned_folder(path):
        raise PermissionError(f"{path} must be yours alone (chmod 700 {path}), or set {FOLDER_VARIABLE}")
    return path


def peer_uid(sock: socket.socket) -> int:
    """The user of the process at the other end of a Unix socket (Linux: SO_PEERCRED)."""
    credentials = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", credentials)[1]


def package_folder() -> Path:
    return Path(__file__).resolve().parent.parent


def environment_key(environ: dict[str, str] | None = None) -> str:
    """16 hex digits that differ wherever a forked process would differ from a fresh one."""
    environ = os.environ if environ is None else environ
    digest = hashlib.sha256()
    # the interpreter by its file: `python` and `python3` of one venv are links to it; the venv
    # (sys.prefix) tells two venvs of one interpreter apart
    # the interpreter's flags (-O, -X ..., -W ...) and the cgroup (a Slurm job's CPUs and GPUs)
    # are the process's own: a command with others runs by itself
    flags = (repr(sys.flags), repr(sorted(sys._xoptions.items())), repr(sys.warnoptions), cgroup())
    for part in (os.path.realpath(sys.executable), sys.version, sys.prefix, str(package_folder()), *flags):
        digest.update(part.encode() + b"\0")
    for path in sorted(package_folder().rglob("*.py")):
        stat = path.stat()
        digest.update(f"{path}:{stat.st_size}:{stat.st_mtime_ns}\0".encode())
    for name in ("torch", "hydra", "omegaconf", "numpy", "joblib", "tensorboard"):
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec and spec.origin else ""
        stamp = os.stat(origin).st_mtime_ns if origin and os.path.exists(origin) else 0
        digest.update(f"{name}:{origin}:{stamp}\0".encode())
    for name in sorted(environ):
        if name.startswith(IMPORT_TIME_PREFIXES) and name not in READ_LATER:
            digest.update(f"{name}={environ[name]}\0".encode())
    return digest.hexdigest()[:16]


def cgroup() -> str:
    try:
        with open("/proc/self/cgroup") as groups:
            return groups.read()
    except OSError:
        return ""


def socket_path(key: str) -> Path:
    return folder() / f"{key}.sock"


def send(sock: socket.socket, message: dict, fds: list[int] | None = None) -> None:
    """One message: its length, then its JSON; `fds` travel with the first bytes."""
    data = json.dumps(message).encode()
    framed = LENGTH.pack(len(data)) + data
    if fds:
        sent = socket.send_fds(sock, [framed], fds)
        sock.sendall(framed[sent:])
    else:
        sock.sendall(framed)


def receive(sock: socket.socket, max_fds: int = 0) -> tuple[dict | None, list[int]]:
    """(message, fds that came with it); (None, []) where the other side closed first."""
    fds: list[int] = []
    head = b""
    while len(head) < LENGTH.size:
        if max_fds and not fds:
            chunk, fds, _, _ = socket.recv_fds(sock, LENGTH.size - len(head), max_fds)
        else:
            chunk = sock.recv(LENGTH.size - len(head))
        if not chunk:
            return None, fds
        head += chunk
    (length,) = LENGTH.unpack(head)
    body = b""
    while len(body) < length:
        chunk = sock.recv(length - len(body))
        if not chunk:
            return None, fds
        body += chunk
    return json.loads(body), fds
