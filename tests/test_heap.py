"""The garbage collector over a command's life (trainer/heap.py), each case in a fresh
interpreter: the collector's state is the whole process's."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = r"""
import gc, json, os
from trainer import heap, timing

report = {}
heap.pause()
report["paused"] = not gc.isenabled()
imported = [[index] for index in range(1000)]  # what imports leave: tracked by the collector
heap.freeze_and_resume()
report["enabled"] = gc.isenabled()
report["frozen_imports"] = gc.get_freeze_count()
timing.start_run()
with heap.imports():
    job = [[index] for index in range(1000)]  # a run has begun: its objects are a job's
report["enabled_again"] = gc.isenabled()
report["frozen_after_a_run"] = gc.get_freeze_count()
try:
    with heap.imports():
        import a_module_that_is_not_there  # noqa: F401
except ImportError:
    report["enabled_after_a_failed_import"] = gc.isenabled()
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


def test_imports_are_frozen_until_a_run_begins_and_a_forked_process_freezes_what_it_inherited():
    report = probe()
    assert report["paused"] and report["enabled"] and report["enabled_again"]
    assert report["enabled_after_a_failed_import"]
    assert report["frozen_imports"] >= 1000
    # a job's objects stay where the collector can free them
    assert report["frozen_after_a_run"] == report["frozen_imports"]
    assert report["unfrozen_parent"] == 0
    assert report["frozen_in_child"] >= 2000  # everything the child was forked with
