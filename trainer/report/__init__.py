"""The sweep report: `python -m trainer.report SWEEP` (or `trainer-report SWEEP`) turns the job
folders of a sweep into report.md, report.csv, speedup.png and accuracy_vs_time.png.

One module per concern, each reading only what the one before it made:

    jobs.py      job folders -> Job (overrides, metrics.json, status, numbers)
    rows.py      jobs -> Row (seeds grouped), the baseline, speed-up and accuracy change
    effects.py   rows of a full factorial -> each toggle's mean effect
    tables.py    rows -> report.md and report.csv
    plots.py     rows and jobs -> the two charts (matplotlib, imported only to draw them)
    __main__.py  the command line

Nothing here imports torch: the report reads what the runs wrote, on any machine.
"""
