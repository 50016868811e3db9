"""CUDA's driver started ahead (trainer/cuda_driver.py): once per process, only where a driver
is loaded and the run itself uses CUDA, through ctypes (which lets go of Python's lock)."""

import contextlib
import site
import threading
import time
from pathlib import Path

import pytest

from trainer import cuda_driver


class FakeLibcuda:
    def __init__(self, calls: list):
        self.calls = calls

    def cuInit(self, flags: int) -> int:  # noqa: N802 (the driver's name)
        self.calls.append((flags, threading.current_thread().name))
        return 0


@pytest.fixture
def driver(monkeypatch):
    calls = []
    monkeypatch.setattr(cuda_driver, "_started", False)
    monkeypatch.setattr(cuda_driver.ctypes, "CDLL", lambda name: FakeLibcuda(calls))
    return calls


def join_driver_thread():
    for thread in threading.enumerate():
        if thread.name == "cuda-driver":
            thread.join()


def test_started_once_in_a_thread_where_a_driver_is_loaded(driver, monkeypatch):
    monkeypatch.setattr(cuda_driver, "loaded", lambda: True)
    cuda_driver.start_ahead()
    cuda_driver.start_ahead()
    join_driver_thread()
    assert driver == [(0, "cuda-driver")]


def test_nothing_without_a_driver(driver, monkeypatch):
    monkeypatch.setattr(cuda_driver, "loaded", lambda: False)
    cuda_driver.start_ahead()
    join_driver_thread()
    assert driver == []


def test_a_missing_library_is_left_to_torch(monkeypatch):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(cuda_driver.ctypes, "CDLL", missing)
    cuda_driver.initialize()  # no exception: torch's own first call reports it


@pytest.mark.parametrize(
    ("device", "ddp", "expected"),
    [
        ("auto", False, True),
        ("cuda", False, True),
        ("cuda:1", False, True),
        ("cpu", False, False),
        ("cuda", True, False),
    ],
)
def test_only_a_run_on_cuda_in_this_process(device, ddp, expected):
    assert cuda_driver.runs_here(device, ddp) is expected


def test_a_process_that_started_the_driver_forks_no_server(driver, monkeypatch):
    """torch does not know of a driver started through ctypes: the forkserver asks this module
    before it would fork a server (for a later DDP job's ranks) from this process."""
    from trainer import forkserver

    monkeypatch.setattr(cuda_driver, "loaded", lambda: True)
    cuda_driver.start_ahead()
    join_driver_thread()
    assert cuda_driver.started()
    assert not forkserver.forks_unmarked()


def library_not_loaded() -> Path | None:
    """The smallest shared library of 30 MB or more among the installed packages (torch's CUDA
    wheels bring dozens) that this process has not loaded: tens of milliseconds to load, from a
    warm page cache."""
    loaded = Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else ""
    found = [
        path
        for folder in map(Path, site.getsitepackages())
        for path in folder.glob("nvidia/**/lib/*.so*")
        if path.name not in loaded and path.stat().st_size >= 30 * 2**20
    ]
    return min(found, key=lambda path: path.stat().st_size, default=None)


def test_a_library_loads_while_the_main_thread_goes_on():
    """ctypes.CDLL's own dlopen holds Python's lock for as long as the loader works; `load`'s
    lets the main thread (a run's imports) go on meanwhile."""
    library = library_not_loaded()
    if library is None:
        pytest.skip("no shared library of 30 MB or more that this process has not loaded")
    done, ticks = threading.Event(), 0

    def load():
        with contextlib.suppress(OSError):  # one that needs another first: loading is what counts
            cuda_driver.load(str(library))
        done.set()

    thread = threading.Thread(target=load)
    started = time.perf_counter()
    thread.start()
    while not done.is_set():
        time.sleep(0.001)
        ticks += 1
    took = time.perf_counter() - started
    thread.join()
    if took < 0.02:
        pytest.skip(f"{library.name} loaded in {took * 1000:.0f} ms: too soon to tell")
    assert ticks >= 3  # held: 1, the tick before the loader took the lock


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"device": "auto", "ddp": False}, True),
        ({"device": "cpu", "ddp": False}, False),
        ({"device": "cuda", "ddp": True}, False),
        (
            {"device": "cuda", "ddp": False, "hydra": {"job": {"env_set": {"CUDA_VISIBLE_DEVICES": "1"}}}},
            False,
        ),
        ({"device": "cuda", "ddp": False, "hydra": {"job": {"env_set": {"OMP_NUM_THREADS": "4"}}}}, True),
    ],
)
def test_a_single_run_starts_it_once_its_command_line_has_passed(driver, monkeypatch, settings, expected):
    """Right after the checks, except where Hydra's job environment would change what cuInit
    sees (the job starts it then, once that is set)."""
    from omegaconf import OmegaConf

    monkeypatch.setattr(cuda_driver, "loaded", lambda: True)
    cuda_driver.start_for_run(OmegaConf.create(settings))
    join_driver_thread()
    assert (driver == [(0, "cuda-driver")]) is expected
