"""The garbage collector over a command's life (trainer/heap.py), each case in a fresh
interpreter: the collector's state is the whole process's."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = r"""
import gc, json, os
from trainer import heap

report = {}
heap.pause_for_imports()
report["paused"] = not gc.isenabled()
made = [[index] for index in range(1000)]  # tracked by the collector
heap.freeze_imports()
report["enabled"] = gc.isenabled()
report["frozen_first"] = gc.get_freeze_count()
later = [[index] for index in range(1000)]  # a later job's objects
heap.freeze_imports()
report["frozen_again"] = gc.get_freeze_count()
gc.unfreeze()
reading, writing = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(writing, str(gc.get_freeze_count()).encode())
    os._exit(0)
os.waitpid(pid, 0)
report["unfrozen_parent"] = gc.get_freeze_count()
report["frozen_in_child"] = int(os.read(reading, 64))
print(json.dumps(report))
"""


def probe() -> dict:
    finished = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    return json.loads(finished.stdout)


def test_imports_are_frozen_once_before_the_first_run_and_a_forked_process_freezes_what_it_inherited():
    report = probe()
    assert report["paused"] and report["enabled"]
    assert report["frozen_first"] >= 1000  # the imports and what the command made before its run
    # a later job's objects stay where the collector can free them
    assert report["frozen_again"] == report["frozen_first"]
    assert report["unfrozen_parent"] == 0
    assert report["frozen_in_child"] >= 2000  # everything the child was forked with
