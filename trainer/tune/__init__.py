"""`python -m trainer.tune`: which speed toggles pay on this device, data and model, measured,
and a perf preset (perf/tuned.yaml) that turns on exactly those.

    candidates.py  the toggles the tuner tries and which of them can act on a device
    bench.py       measuring settings: one process per trial (fresh, or forked: trainer/trial_fork.py),
                   repeats until the comparison is clear, a time budget, trials of this machine
                   reused on --resume
    search.py      deciding: add one at a time, keep what pays beyond the noise, take each out
                   of the kept set again, add back, then larger batches
    output.py      tuned.yaml, tune.md, tune.csv, tune.png
    __main__.py    the command line
"""
