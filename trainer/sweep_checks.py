"""Hydra's basic sweeper left out of checking what the command line checked already.

Before it launches a batch, Hydra's basic sweeper composes every job of it once more
(`Sweeper.validate_batch_is_legal`), so that a job that does not compose fails before the first
one starts. The command line's checks (trainer/cli_checks.py) compose and check every job of a
sweep of up to 64 jobs before Hydra makes a folder, the same compositions and more (the schema,
the machine): Hydra's pass then only repeats them, one composition per job before the first job
starts (0.13 s each on a 2-core CPU, 0.5 s of a 4-job sweep's start). Where the checks did not
see every job (a larger sweep, an interval, a config's own hydra.sweeper.params), Hydra
checks as before. Hydra has no switch for it; the method is wrapped
here, once per process, and asks `jobs_checked`, which the command line's checks set.

Owns: that flag and the wrapper. Must not touch: the checks themselves (cli_checks.py).
"""

from __future__ import annotations

jobs_checked = False  # every job of this command's sweep composed and checked already


def install() -> None:
    """Hydra's basic sweeper's check of a batch, skipped while `jobs_checked`. Hydra's plugin
    scan imports its plugins' modules anew, in place of any imported before it: the class to
    wrap is the one in its registry, so the scan comes first."""
    from hydra.core.plugins import Plugins

    Plugins.instance()
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    original = BasicSweeper.validate_batch_is_legal
    if getattr(original, "skips_checked_jobs", False):
        return

    def validate_batch_is_legal(self, batch):
        if not jobs_checked:
            original(self, batch)

    validate_batch_is_legal.skips_checked_jobs = True
    BasicSweeper.validate_batch_is_legal = validate_batch_is_legal
