"""torch's bytecode cached in the user's cache folder only where its install has none and
Python would write none (trainer/bytecode.py), shown on a small package in its place."""

from __future__ import annotations

import json
import os
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PROBE = """
import json, os, sys
from trainer.bytecode import cache_bytecode, first_use_note
folder = cache_bytecode("slowpkg")
import slowpkg
print(first_use_note() or "", file=sys.stderr, end="")
print(json.dumps({"folder": folder and str(folder), "prefix": sys.pycache_prefix,
                  "inherited": os.environ.get("PYTHONPYCACHEPREFIX")}))
"""


@pytest.fixture
def package(tmp_path) -> Path:
    """A package with no bytecode: the source of slowpkg/__init__.py."""
    source = tmp_path / "site" / "slowpkg" / "__init__.py"
    source.parent.mkdir(parents=True)
    source.write_text("VALUE = 1\n")
    return source


def start(tmp_path: Path, *, writes_none: bool = True, prefix: str | None = None):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPYCACHEPREFIX", "PYTHONDONTWRITEBYTECODE")}
    path = [str(tmp_path / "site"), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    env.update(PYTHONPATH=os.pathsep.join(path), XDG_CACHE_HOME=str(tmp_path / "cache"))
    if writes_none:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    if prefix:
        env["PYTHONPYCACHEPREFIX"] = prefix
    finished = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env)
    assert finished.returncode == 0, finished.stderr
    return json.loads(finished.stdout), finished.stderr


def cached_copies(root: Path) -> list[Path]:
    return [path for path in root.rglob("*.pyc") if path.parent.name == "slowpkg"]


def test_a_package_without_bytecode_gets_it_cached_once_and_read_after(tmp_path, package):
    folder = tmp_path / "cache" / "trainer" / "pycache"

    first, said = start(tmp_path)
    assert first == {"folder": str(folder), "prefix": str(folder), "inherited": str(folder)}
    assert "installed without bytecode" in said and f"{folder}" in said
    [cached] = cached_copies(folder)
    assert not list((tmp_path / "site").rglob("*.pyc"))  # nothing written beside the sources
    written = cached.stat().st_mtime_ns

    second, said_again = start(tmp_path)
    assert second == first and said_again == ""  # one line, the first time only
    assert cached.stat().st_mtime_ns == written  # read from the cache, not compiled again


def test_current_bytecode_beside_the_sources_is_left_as_it_is(tmp_path, package):
    py_compile.compile(str(package), doraise=True)
    outcome, said = start(tmp_path)
    assert outcome == {"folder": None, "prefix": None, "inherited": None} and said == ""
    assert not (tmp_path / "cache").exists()


def test_bytecode_older_than_its_source_counts_as_none(tmp_path, package):
    py_compile.compile(str(package), doraise=True)
    later = package.stat().st_mtime + 10
    os.utime(package, (later, later))
    outcome, _ = start(tmp_path)
    assert outcome["folder"] == str(tmp_path / "cache" / "trainer" / "pycache")


def test_a_python_that_writes_bytecode_itself_is_left_to_it(tmp_path, package):
    outcome, _ = start(tmp_path, writes_none=False)
    assert outcome == {"folder": None, "prefix": None, "inherited": None}
    assert list((package.parent / "__pycache__").glob("__init__.*.pyc"))  # Python's own, beside it


def test_a_prefix_the_user_chose_is_kept(tmp_path, package):
    mine = str(tmp_path / "mine")
    outcome, said = start(tmp_path, prefix=mine)
    assert outcome == {"folder": None, "prefix": mine, "inherited": mine} and said == ""
    assert not (tmp_path / "cache").exists()
